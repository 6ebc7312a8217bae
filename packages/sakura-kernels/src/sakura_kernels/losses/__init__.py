"""Losses from hidden states: the ``tokens x vocab`` logits never exist.

* :mod:`.chunked`: ``chunked_causal_lm_loss`` / ``causal_lm_loss`` (the causal-LM
  cross-entropy a chunk of tokens at a time; bf16 matmul, fp32 log-sum-exp);
* :mod:`.preference`: ``sequence_logprobs`` (per-sequence log-probabilities in chunks) and
  ``dpo_loss`` (sigmoid DPO in TRL's argument order);
* :mod:`.reference`: ``reference_logprobs`` (the DPO reference as the policy with its
  adapters disabled, once, before training);
* :mod:`.service`: ``ChunkedLoss``, the ``chunked_loss`` service.
"""
