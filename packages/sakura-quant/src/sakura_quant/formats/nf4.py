"""NF4: 4-bit NormalFloat codes with an fp32 absmax per block, bit-identical to bitsandbytes.

The layout bitsandbytes uses, which this module reproduces exactly:

* the 16 code values below (quantiles of a standard normal, QLoRA, Dettmers et al. 2023);
* one fp32 absmax per block of ``block_size`` consecutive values of the flattened weight;
* a value is scaled by *multiplying* with ``1 / absmax`` (not dividing), clamped to [-1, 1],
  and rounded to the nearest code with ties going to the lower code (the code index is the
  number of midpoints that the value is strictly greater than);
* two codes per byte, the even index in the high nibble; an odd count gets a zero pad.
"""

from __future__ import annotations

import functools

import torch

from sakura_quant import _kernel
from sakura_quant.formats import double_quant
from sakura_quant.formats._blocks import as_blocks, block_absmax, inverse, scale_blocks
from sakura_quant.formats.base import WeightFormat

NF4_CODE = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)


@functools.cache
def _code(device: torch.device) -> torch.Tensor:
    return torch.tensor(NF4_CODE, dtype=torch.float32, device=device)


@functools.cache
def _midpoints(device: torch.device) -> torch.Tensor:
    code = _code(device)
    return (code[:-1] + code[1:]) / 2


@functools.cache
def _pair_table(device: torch.device) -> torch.Tensor:
    """For each byte, the two code values it holds (high nibble first): ``(256, 2)``.

    Expanding a packed weight is then one gather of two floats per byte.
    """
    code = _code(device)
    byte = torch.arange(256, device=device)
    return torch.stack((code[byte >> 4], code[byte & 15]), dim=1).contiguous()


def pack_nibbles_high_first(index: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit indices two per byte, the even index in the high nibble."""
    flat = index.reshape(-1).to(torch.uint8)
    if flat.numel() % 2:
        flat = torch.nn.functional.pad(flat, (0, 1))
    pairs = flat.view(-1, 2)
    return (pairs[:, 0] << 4) | pairs[:, 1]


class NF4(WeightFormat):
    name = "nf4"
    default_block_size = 64
    supports_double_quant = True
    data_dtype = torch.uint8
    values_per_code = 2

    def quantize(self, weight: torch.Tensor, block_size: int) -> dict[str, torch.Tensor]:
        fast = _quantize_cpu(weight, block_size)
        if fast is not None:
            return fast
        numel = weight.numel()
        blocks = as_blocks(weight, block_size)
        absmax = block_absmax(blocks)
        scaled = (blocks * inverse(absmax).unsqueeze(1)).clamp_(-1.0, 1.0)
        # bucketize (right=False) counts the midpoints strictly below the value: a value
        # exactly on a midpoint goes to the lower code, as in bitsandbytes.
        # An odd count keeps one padding zero: it fills the last low nibble with the zero code.
        kept = scaled.view(-1)[: numel + numel % 2]
        index = torch.bucketize(kept, _midpoints(weight.device), out_int32=True)
        return {"data": pack_nibbles_high_first(index), "scales": absmax}

    def dequantize(
        self, tensors: dict[str, torch.Tensor], numel: int, block_size: int
    ) -> torch.Tensor:
        data = tensors["data"]
        values = torch.nn.functional.embedding(data.long(), _pair_table(data.device)).view(-1)
        return scale_blocks(values, tensors["scales"], numel, block_size)

    def dequantize_to(
        self, tensors: dict[str, torch.Tensor], numel: int, block_size: int, dtype: torch.dtype
    ) -> torch.Tensor:
        fast = _dequantize_cpu(tensors["data"], tensors["scales"], numel, block_size, dtype)
        if fast is None:
            fast = dequantize_cuda(tensors, numel, block_size, dtype)
        if fast is not None:
            return fast
        return self.dequantize(tensors, numel, block_size).to(dtype)


# The C++ kernels (sakura_quant/csrc/nf4_cpu.cpp) do the same arithmetic as the torch code
# above in one pass; they take contiguous CPU tensors in fp32 or bf16.
_KERNEL_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}


def _threads() -> int:
    return max(1, torch.get_num_threads())


def _sizes_error(what: str, numel: int, block_size: int, **lengths: int) -> ValueError:
    given = ", ".join(f"{k}={v}" for k, v in lengths.items())
    return ValueError(
        f"sakura-quant: the {what} refused inconsistent sizes (numel={numel}, "
        f"block_size={block_size}, {given}): expected (numel + 1) // 2 packed bytes, "
        "one scale per block and an even block_size in [2, 2**31]"
    )


def _quantize_cpu(weight: torch.Tensor, block_size: int) -> dict[str, torch.Tensor] | None:
    suffix = _KERNEL_DTYPES.get(weight.dtype)
    if suffix is None or weight.device.type != "cpu" or weight.requires_grad:
        return None
    lib = _kernel.LIBRARY.load()
    if lib is None:
        return None
    x = weight.detach().contiguous()
    numel = x.numel()
    absmax = torch.empty(-(-numel // block_size), dtype=torch.float32)
    out = torch.empty((numel + 1) // 2, dtype=torch.uint8)
    mid = _midpoints(torch.device("cpu"))
    fn = getattr(lib, f"sakura_nf4_quantize_{suffix}")
    status = fn(
        x.data_ptr(),
        numel,
        numel,
        block_size,
        mid.data_ptr(),
        absmax.data_ptr(),
        absmax.numel(),
        out.data_ptr(),
        out.numel(),
        _threads(),
    )
    if status == _kernel.BAD_ARGUMENTS:
        raise _sizes_error("C++ NF4 quantize kernel", numel, block_size)
    if status:  # quantize_weight refuses them first; the kernel does too
        raise ValueError(f"cannot quantize a weight holding {status} NaN or Inf values")
    return {"data": out, "scales": absmax}


def _dequantize_cpu(
    data: torch.Tensor, scales: torch.Tensor, numel: int, block_size: int, dtype: torch.dtype
) -> torch.Tensor | None:
    suffix = _KERNEL_DTYPES.get(dtype)
    if (
        suffix is None
        or data.device.type != "cpu"
        or scales.device.type != "cpu"
        or data.dtype != torch.uint8
        or scales.dtype != torch.float32
    ):
        return None
    lib = _kernel.LIBRARY.load()
    if lib is None:
        return None
    data = data.contiguous()
    scales = scales.contiguous()
    out = torch.empty(numel, dtype=dtype)
    code = _code(torch.device("cpu"))
    fn = getattr(lib, f"sakura_nf4_dequantize_{suffix}")
    status = fn(
        data.data_ptr(),
        data.numel(),
        scales.data_ptr(),
        scales.numel(),
        numel,
        block_size,
        code.data_ptr(),
        out.data_ptr(),
        out.numel(),
        _threads(),
    )
    if status:
        raise _sizes_error(
            "C++ NF4 dequantize kernel", numel, block_size, data=data.numel(), scales=scales.numel()
        )
    return out


# The CUDA kernel (sakura_quant/csrc/nf4_cuda.cu) expands NF4 on the device with the same
# bits, from fp32 scales or straight from double-quantized ones; compiled with nvcc on
# first use where CUDA is available.  Untested on a GPU so far (see the README).


def dequantize_cuda(
    tensors: dict[str, torch.Tensor], numel: int, block_size: int, dtype: torch.dtype
) -> torch.Tensor | None:
    """The flat weight in ``dtype`` from NF4 ``tensors`` on a CUDA device (``"scales"`` fp32,
    or uint8 codes with ``"scales_scale"`` / ``"scales_offset"``); None where the kernel
    does not apply (another device or dtype, no kernel): the caller then takes the torch
    path."""
    data, scales = tensors["data"], tensors["scales"]
    suffix = _KERNEL_DTYPES.get(dtype)
    device = data.device
    if suffix is None or device.type != "cuda" or any(t.device != device for t in tensors.values()):
        return None
    if data.dtype != torch.uint8 or scales.dtype not in (torch.float32, torch.uint8):
        return None
    lib = _kernel.CUDA_LIBRARY.load()
    if lib is None:
        return None
    args, out, _alive = kernel_arguments(tensors, numel, block_size, dtype)
    with torch.cuda.device(device):
        stream = torch.cuda.current_stream(device).cuda_stream
        status = getattr(lib, f"sakura_nf4_dequantize_cuda_{suffix}")(*args, stream)
    if status == _kernel.BAD_ARGUMENTS:
        raise _sizes_error(
            "CUDA NF4 kernel", numel, block_size, **{k: t.numel() for k, t in tensors.items()}
        )
    if status != 0:
        raise RuntimeError(
            f"sakura-quant: the CUDA NF4 kernel failed to launch (cudaError {status})"
        )
    return out


def kernel_arguments(
    tensors: dict[str, torch.Tensor], numel: int, block_size: int, dtype: torch.dtype
) -> tuple[list[int | None], torch.Tensor, list[torch.Tensor]]:
    """The arguments of the NF4 dequantize kernel before its stream (its host emulation
    takes the same), the output they fill, and the tensors they point into (alive until
    the kernel has run)."""
    device = tensors["data"].device
    data, scales = tensors["data"].contiguous(), tensors["scales"].contiguous()
    absmax: torch.Tensor | None = None
    codes: torch.Tensor | None = None
    values: torch.Tensor | None = None
    scale_absmax: torch.Tensor | None = None
    offset: torch.Tensor | None = None
    if scales.dtype == torch.uint8:  # double-quantized: codes, map, their absmax, offset
        codes = scales
        values = double_quant._code(device)
        scale_absmax = tensors["scales_scale"].float().contiguous()
        offset = tensors["scales_offset"].float().reshape(-1).contiguous()
        if offset.numel() != 1:
            raise ValueError(f"scales_offset holds {offset.numel()} values, expected 1")
    else:
        absmax = scales.float().contiguous()
    out = torch.empty(numel, dtype=dtype, device=device)
    code = _code(device)

    def ptr(t: torch.Tensor | None) -> int | None:
        return None if t is None else t.data_ptr()

    def length(t: torch.Tensor | None) -> int:
        return 0 if t is None else t.numel()

    args = [
        data.data_ptr(),
        data.numel(),
        ptr(absmax),
        length(absmax),
        ptr(codes),
        length(codes),
        ptr(values),
        ptr(scale_absmax),
        length(scale_absmax),
        ptr(offset),
        numel,
        block_size,
        code.data_ptr(),
        out.data_ptr(),
        out.numel(),
    ]
    alive = [
        t for t in (data, absmax, codes, values, scale_absmax, offset, code, out) if t is not None
    ]
    return args, out, alive
