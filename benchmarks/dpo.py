"""DPO on tiny preference pairs: sakura-kernels' losses against TRL's ``DPOTrainer``.

Both sides train the same tiny Llama (built from a config, same seed), the same PEFT LoRA
adapters (r=16 on every projection, no dropout, same seed), on the same random-token
preference pairs (a prompt of ``--prompt`` tokens, chosen and rejected completions of
``--completion`` tokens ending in EOS), in the same order, with AdamW (constant
``--lr``, no weight decay, gradients clipped at 1.0), ``beta=--beta``, in fp32 (TRL's
``DPOConfig`` defaults to ``bf16=True``; it is set to False here, and ``--bf16`` puts both
sides under bf16 autocast):

The adapters start with random ``B`` as well as ``A`` (``--lora-init random``), so the
policy's log-probabilities differ from the base's and the losses compare real arithmetic
(PEFT's default ``B = 0`` makes every adapter gradient but B's zero at step 0, and Adam's
first update of near-zero gradients amplifies rounding). Given a PEFT model that already
has an adapter, TRL copies it as its ``"ref"`` adapter: its reference is the initial policy,
so the sakura side then calls ``reference_logprobs(..., disable_adapters=False)`` (with
``--lora-init default`` the initial policy is the base, adapters off, on both sides).

* ``sakura``  a raw loop: ``reference_logprobs(model, batches)`` once before training (the
  policy with its adapters disabled; its time is printed apart), then per step
  ``preference_logprobs`` (chosen and rejected in one forward, log-probabilities from the
  hidden states in chunks: no logits) + ``dpo_loss`` + backward + step;
* ``trl``     ``trl.DPOTrainer`` (``DPOConfig`` defaults otherwise: the reference pass runs
  in every step with the adapters disabled, TRL's own fused head for the log-probabilities)
  on the same pairs, tokenized by a word-level tokenizer whose ids are the random tokens
  (checked equal to the ids the sakura side uses).

Each trial runs each side in a fresh process (``--trials``, interleaved and rotated with
``sakura_bench.measure.interleaved``), which reports its step times (after ``--warmup``
steps), its peak RSS (``VmHWM``) and its per-step losses. Printed: the median step time with
its min-max over trials, the per-trial ratio trl / sakura (> 1: sakura faster), peak RSS, the
losses of the first trial side by side (step 0 must agree: same model, adapters and data),
the CPU and the load average before and after.

    python benchmarks/dpo.py                 # defaults
    python benchmarks/dpo.py --quick         # a smoke run (1 trial, 3 steps)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import pin_threads, require_status_kib

from sakura_bench.measure import (
    interleaved,
    load_average,
    machine_note,
    ratio_summary,
    summary,
)

SIDES = ("sakura", "trl")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--prompt", type=int, default=48)
    p.add_argument("--completion", type=int, default=80)
    p.add_argument("--pairs", type=int, default=4, help="pairs per step")
    p.add_argument("--steps", type=int, default=6, help="timed steps per trial")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument(
        "--lora-init",
        choices=("random", "default"),
        default="random",
        help="random: B random too, so the step-0 loss is not log 2 (default); default: B=0",
    )
    p.add_argument("--chunk", type=int, default=1024, help="sakura: tokens per loss chunk")
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    p.add_argument("--bf16", action="store_true", help="bf16 autocast on both sides (default fp32)")
    p.add_argument("--quick", action="store_true", help="1 trial, 3 steps, smaller model")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.trials, args.steps, args.warmup = 1, 3, 1
        args.hidden, args.layers, args.vocab = 128, 2, 2048
        args.prompt, args.completion = 16, 24
    return args


# --- shared by both sides: model, adapters, data ------------------------------------------


def build_model(args: argparse.Namespace) -> Any:
    import peft
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 2,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=args.vocab,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        use_cache=False,
    )
    base = transformers.LlamaForCausalLM(config)
    torch.manual_seed(1)
    lora = peft.LoraConfig(
        r=16,
        lora_alpha=32,
        lora_dropout=0.0,
        target_modules=[
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
        task_type="CAUSAL_LM",
        # B = 0 (PEFT's default) makes the policy equal the reference at step 0, so the
        # first loss is log 2 whatever the code computes; random B makes it a real check.
        init_lora_weights=args.lora_init == "default",
    )
    return peft.get_peft_model(base, lora)


def pair_ids(args: argparse.Namespace) -> list[dict[str, list[int]]]:
    """Random-token pairs: ids 3..vocab-1 (0 pad, 1 bos, 2 eos); completions end in EOS."""
    import torch

    g = torch.Generator().manual_seed(7)
    count = args.pairs * (args.steps + args.warmup)
    out = []
    for _ in range(count):

        def tokens(n: int) -> list[int]:
            return torch.randint(3, args.vocab, (n,), generator=g).tolist()

        out.append(
            {
                "prompt": tokens(args.prompt),
                "chosen": [*tokens(args.completion - 1), 2],
                "rejected": [*tokens(args.completion - 1), 2],
            }
        )
    return out


def peak_rss_mib() -> float:
    return require_status_kib("VmHWM") / 1024


# --- sakura ---------------------------------------------------------------------------


def run_sakura(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from sakura_kernels.losses.preference import dpo_loss
    from sakura_kernels.losses.reference import preference_logprobs, reference_logprobs

    model = build_model(args)
    model.train()
    pairs = pair_ids(args)
    batches = []
    for start in range(0, len(pairs), args.pairs):
        part = pairs[start : start + args.pairs]
        batch: dict[str, Any] = {"id": list(range(start, start + len(part)))}
        for side in ("chosen", "rejected"):
            ids = torch.tensor([p["prompt"] + p[side] for p in part])
            labels = ids.clone()
            labels[:, : args.prompt] = -100
            batch[f"{side}_input_ids"], batch[f"{side}_labels"] = ids, labels
        batches.append(batch)
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0
    )
    t0 = time.perf_counter()
    # TRL, given a PEFT model with an adapter, copies that adapter as "ref": its reference is
    # the initial policy. With B = 0 that is the base (adapters off); with random B, the
    # policy as it is before the first step.
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
        reference = reference_logprobs(
            model, batches, chunk_size=args.chunk, disable_adapters=args.lora_init == "default"
        )
    reference_s = time.perf_counter() - t0
    losses, times = [], []
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16)
    for batch in batches:
        t0 = time.perf_counter()
        with autocast:
            chosen, rejected = preference_logprobs(model, batch, chunk_size=args.chunk)
        ref_chosen, ref_rejected = reference.lookup(batch["id"])
        per_pair, _, _ = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, args.beta)
        loss = per_pair.mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    return {
        "step_s": times[args.warmup :],
        "losses": losses,
        "reference_s": reference_s,
        "peak_rss_mib": peak_rss_mib(),
    }


# --- TRL ------------------------------------------------------------------------------


def word_tokenizer(vocab: int) -> Any:
    """A word-level tokenizer whose token ``t<i>`` is id ``i``: random ids round-trip
    through text, so TRL tokenizes exactly the ids the sakura side uses."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, vocab)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<pad>"))  # noqa: S106 (a token)
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    special = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>"}
    return PreTrainedTokenizerFast(tokenizer_object=tok, **special)


def text(ids: list[int]) -> str:
    return " ".join("</s>" if i == 2 else f"t{i}" for i in ids)


def run_trl(args: argparse.Namespace) -> dict[str, Any]:
    import datasets
    import transformers
    from trl import DPOConfig, DPOTrainer

    model = build_model(args)
    tokenizer = word_tokenizer(args.vocab)
    pairs = pair_ids(args)
    assert tokenizer(text(pairs[0]["prompt"]))["input_ids"] == pairs[0]["prompt"]
    rows = {
        "prompt": [text(p["prompt"]) for p in pairs],
        "chosen": [" " + text(p["chosen"]) for p in pairs],
        "rejected": [" " + text(p["rejected"]) for p in pairs],
    }
    times: list[float] = []

    class Clock(transformers.TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, *a: Any, **k: Any) -> None:
            self.t0 = time.perf_counter()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            times.append(time.perf_counter() - self.t0)

    config = DPOConfig(
        output_dir=os.path.join(tempfile.gettempdir(), "sakura-dpo-bench"),
        per_device_train_batch_size=args.pairs,
        max_steps=len(pairs) // args.pairs,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=args.beta,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        train_sampling_strategy="sequential",
        dataloader_num_workers=0,
        seed=0,
        # TRL's configs default to bf16=True (autocast); the sakura side autocasts alike.
        bf16=args.bf16,
    )
    trainer = DPOTrainer(
        model=model,
        args=config,
        train_dataset=datasets.Dataset.from_dict(rows),
        processing_class=tokenizer,
        callbacks=[Clock()],
    )
    first = trainer.train_dataset[0]
    assert list(first["prompt_ids"]) == pairs[0]["prompt"]
    assert list(first["chosen_ids"]) == pairs[0]["chosen"], "TRL tokenized other ids"
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return {"step_s": times[args.warmup :], "losses": losses, "peak_rss_mib": peak_rss_mib()}


# --- driver ---------------------------------------------------------------------------


def child(args: argparse.Namespace) -> None:
    pin_threads(args.threads)
    os.environ.setdefault("TQDM_DISABLE", "1")
    result = run_sakura(args) if args.child == "sakura" else run_trl(args)
    print("RESULT " + json.dumps(result))


def spawn(side: str, argv: list[str]) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, __file__, *argv, "--child", side],
        capture_output=True,
        text=True,
        check=False,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{side} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
    return result


def main(argv: list[str] | None = None) -> None:
    raw = sys.argv[1:] if argv is None else argv
    args = parse(raw)
    if args.child:
        child(args)
        return
    before = load_average()
    print(
        f"DPO, tiny Llama hidden={args.hidden} layers={args.layers} vocab={args.vocab}, LoRA "
        f"r=16 on every projection; {args.pairs} pairs a step of {args.prompt} prompt + "
        f"{args.completion} completion tokens; {args.steps} timed steps after {args.warmup}; "
        f"{args.trials} trials; {args.threads} threads"
    )
    print(machine_note())
    results = interleaved(
        {side: (lambda trial, side=side: spawn(side, raw)) for side in SIDES},
        args.trials,
        on_trial=lambda i, r: print(
            f"  trial {i}: "
            + ", ".join(
                f"{k} {summary(v['step_s']).median * 1e3:.0f} ms/step" for k, v in r.items()
            )
        ),
    )
    medians = {side: [summary(r["step_s"]).median for r in results[side]] for side in SIDES}
    print("\nstep time (median over trials of each trial's median step; min-max):")
    for side in SIDES:
        print(f"  {side:7s} {summary(medians[side]).format(unit=' s')}")
    ratio = ratio_summary(medians["trl"], medians["sakura"])
    print(f"  trl / sakura: {ratio.format(unit='x')}  (> 1: sakura faster)")
    ref = summary([r["reference_s"] for r in results["sakura"]])
    print(f"  sakura's reference pass, once before training: {ref.format(unit=' s')}")
    print("\npeak RSS (VmHWM of each fresh process; median, min-max):")
    rss = {side: [r["peak_rss_mib"] for r in results[side]] for side in SIDES}
    for side in SIDES:
        print(f"  {side:7s} {summary(rss[side]).format(unit=' MiB')}")
    print("\nlosses of trial 0, step by step (step 0: same model, adapters and data):")
    ours, theirs = results["sakura"][0]["losses"], results["trl"][0]["losses"]
    for step, (a, b) in enumerate(zip(ours, theirs, strict=False)):
        print(f"  step {step}: sakura {a:.6f}  trl {b:.6f}  diff {a - b:+.2e}")
    print("\n" + machine_note(before))
    if args.json:
        from _common import write_json

        write_json(
            args.json,
            {"args": vars(args), "results": results, "machine": machine_note(before)},
        )


if __name__ == "__main__":
    main()
