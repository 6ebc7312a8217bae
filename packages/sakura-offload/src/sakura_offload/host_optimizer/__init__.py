"""The host optimizer: AdamW whose moments and fp32 master weights live in host RAM.

* :mod:`.optimizer`: ``OffloadAdamW``, the ``torch.optim.Optimizer``;
* :mod:`.service`: ``OffloadAdamWService``, the ``offload_adamw`` service;
* :mod:`.options`: validation of their options;
* :mod:`.placement`: ``moment_dtype="auto"``, ``pin_moments``, ``eager=None``, decided from
  the host RAM;
* :mod:`.state_layout`: new states, and the export to / import from torch's AdamW layout;
* :mod:`.moments`: the fp32 / bf16 / int8 moment formats, in torch;
* :mod:`.kernel`: the native kernels (``csrc/``), declared for ``sakura_torch.native``;
* :mod:`.backends`: one update on the C++ kernel, in pure torch, or on the CUDA kernel;
* :mod:`.device_stream`, :mod:`.event_wait`: host updates of CUDA parameters without
  stalling the GPU.

Nothing is imported here: the service module must load without torch (see
``sakura_offload/__init__.py``).  The design: ``docs/offload.md``, "Host AdamW: design".
"""
