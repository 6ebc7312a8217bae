"""What :func:`~sakura_quant.load_model` is built from, beside its streaming loop in
:mod:`sakura_quant.loading`: where the model and its tensors come from (:mod:`.source`: a
path or a cached Hugging Face model name, the config with its overrides, random weights)
and how ``quantize="auto"`` chooses a format from a RAM budget (:mod:`.budget`)."""
