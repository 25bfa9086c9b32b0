"""A second device on a CPU machine: the failures a GPU run has, in a CPU test.

On a GPU the model's weights live on the device and every batch is built on the host, so a batch
tensor that never moved fails at the first op that mixes it with the weights, and every read of a
device value (``.item()``, ``float(t)``, ``.tolist()``, a blocking copy, ``nonzero``) stalls the
stream. On a CPU host and model share one device: the first works and the second is free, so no
ordinary CPU test sees either. :class:`OtherDevice` gives a CPU process a second device:

- tensors "on" it are :class:`DeviceTensor` wrappers around ordinary CPU tensors that report the
  device ``meta`` (the one device type besides ``cpu`` that a CPU build of torch can run autograd
  on); every op on them computes on the wrapped CPU tensors, so values, gradients and optimizer steps
  are exact;
- an op that mixes a device tensor with a host tensor of one or more dimensions raises, as CUDA does
  (host 0-dim scalars are allowed, as on CUDA; a host index tensor into a device tensor is allowed and
  counted as a read, since CUDA makes a blocking copy of it);
- ``torch.zeros(..., device=dev)``, ``x.to(dev)``, ``module.to(dev)`` create device tensors;
- every host read of a device value, and every blocking copy of host data to the device (both stall a
  CUDA stream), is recorded in :attr:`OtherDevice.reads`, with the name of the
  :func:`fastrlhf.engine.device.host_read` block it happened in (None outside one): the CPU counterpart of
  ``torch.cuda.set_sync_debug_mode``.

Code on the emulated device sees ``x.device.type == "meta"``: not ``cpu``, so the GPU branches of
"if on a CPU" switches are the ones taken; not ``cuda``, so no CUDA library is called.
"""

from __future__ import annotations

import contextlib
import traceback

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from fastrlhf.engine.device import current_host_read

DEVICE = torch.device("meta")
aten = torch.ops.aten

# Ops whose output size depends on device values: CUDA reads them back to size the output.
_READING_OPS = {aten.nonzero.default, aten.masked_select.default, aten._unique2.default,
                aten.unique_consecutive.default, aten.unique_dim.default, aten.is_nonzero.default,
                aten.equal.default, aten._local_scalar_dense.default}
# Index ops CUDA lets take host index tensors (copied to the device, blocking).
_INDEX_OPS = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default}


class DeviceTensor(torch.Tensor):
    """A CPU tensor that reports the emulated device; only usable inside :class:`OtherDevice`."""

    @staticmethod
    def __new__(cls, data: torch.Tensor):
        t = torch.Tensor._make_wrapper_subclass(cls, data.shape, strides=data.stride(), dtype=data.dtype,
                                                device=DEVICE, storage_offset=data.storage_offset(),
                                                requires_grad=False)
        t.data_ = data
        return t

    def __repr__(self):
        return f"DeviceTensor({self.data_!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"{func}: a DeviceTensor used outside its OtherDevice context")


class MixedDevices(RuntimeError):
    """What CUDA raises when a host tensor meets a device tensor in one op."""


def _is_emulated(device) -> bool:
    return device is not None and torch.device(device).type == DEVICE.type


class _Factories(TorchFunctionMode):
    """What does not dispatch: ``torch.tensor(data, device=dev)`` and friends copy their data directly
    (wrapped here), and ``.tolist()`` / ``.numpy()`` read it directly (recorded here)."""

    _FUNCS = {torch.tensor, torch.as_tensor, torch.asarray}
    _READS = {torch.Tensor.tolist, torch.Tensor.numpy}

    def __init__(self, owner: OtherDevice):
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self._READS and isinstance(args[0], DeviceTensor):
            self.owner._read(func.__name__)
            return func(args[0].data_, *args[1:], **kwargs)
        if func in self._FUNCS and _is_emulated(kwargs.get("device")):
            out = func(*args, **{**kwargs, "device": "cpu"})
            if out.numel():  # host data copied to the device: CUDA waits for the stream (a blocking copy)
                self.owner._read(f"{func.__name__}(..., device=) (a blocking host-to-device copy)")
            return DeviceTensor(out)
        if func is torch.Tensor.new_tensor and isinstance(args[0], DeviceTensor) and kwargs.get("device") is None:
            return DeviceTensor(args[0].data_.new_tensor(*args[1:], **kwargs))
        return func(*args, **kwargs)


class OtherDevice(TorchDispatchMode):
    """``with OtherDevice() as dev: model.to(dev.device); ...``; see the module docstring."""

    device = DEVICE

    def __init__(self):
        super().__init__()
        self.reads: list[tuple[str | None, str, str]] = []  # (host_read name, op, where in fastrlhf)
        self._factories = _Factories(self)

    def __enter__(self):
        self._factories.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._factories.__exit__(*exc)

    def move(self, module: torch.nn.Module) -> torch.nn.Module:
        """``module`` with its parameters and buffers on the emulated device."""
        return module.to(DEVICE)

    def unnamed_reads(self) -> list[tuple[str, str]]:
        """``(op, where)`` of each read made outside a named :func:`fastrlhf.engine.device.host_read`."""
        return [(op, where) for name, op, where in self.reads if name is None]

    def _read(self, func) -> None:
        frames = [f for f in traceback.extract_stack() if "/fastrlhf/" in f.filename or "/kernels/" in f.filename]
        where = f"{frames[-1].filename.split('/fastrlhf/')[-1]}:{frames[-1].lineno} {frames[-1].name}" if frames \
            else "outside fastrlhf"
        self.reads.append((current_host_read(), str(func), where))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        on_device, on_host, host_scalars, targets = [], [], [], []

        def unwrap(x):
            if isinstance(x, DeviceTensor):
                on_device.append(x)
                return x.data_
            if isinstance(x, torch.Tensor):
                (on_host if x.dim() > 0 else host_scalars).append(x)
            if isinstance(x, torch.device):  # a target device (keyword or, e.g. in aten.to.device, positional)
                targets.append(x)
                return torch.device("cpu") if _is_emulated(x) else x
            return x

        args, kwargs = tree_map(unwrap, args), tree_map(unwrap, kwargs)
        wrap = bool(on_device)
        if targets:
            if _is_emulated(targets[0]):
                wrap = True
                if (on_host or host_scalars) and func is not aten.copy_.default \
                        and not kwargs.get("non_blocking", False):
                    self._read(f"{func} (a blocking host-to-device copy)")
            elif on_device:  # device -> host
                self._read(func)
                wrap = False
        elif func is aten.copy_.default and on_device and (on_host or host_scalars):
            self._read(f"{func} (a copy between host and device)")
        elif on_device and on_host:
            if func in _INDEX_OPS:
                self._read(f"{func} (with a host index tensor)")
            else:
                raise MixedDevices(f"{func}: expected all tensors to be on the same device, but found a host tensor "
                                   f"of shape {tuple(on_host[0].shape)} with device tensors (the emulated second "
                                   "device: this fails on a GPU)")
        if func in _READING_OPS and on_device:
            self._read(func)
        out = func(*args, **kwargs)
        if not wrap:
            return out
        return tree_map(lambda x: _wrap_like(x) if isinstance(x, torch.Tensor) else x, out)


def _wrap_like(data: torch.Tensor) -> DeviceTensor:
    """``data`` wrapped as an inference tensor exactly where it is one: under ``torch.inference_mode`` a view of a
    normal tensor (a model's buffer, say ``inv_freq[None, :, None]`` in transformers 5.17's rotary embedding) is a
    normal tensor, whose version counter autograd then shares with its base, which an inference wrapper refuses."""
    with torch.inference_mode(data.is_inference()):
        return DeviceTensor(data)


@contextlib.contextmanager
def accelerator_syncs():
    """Records DeepSpeed's ``get_accelerator().synchronize()`` calls: a wait for the whole device on CUDA, a
    no-op on the CPU, where only this record shows them (its throughput timer's, for one)."""
    from deepspeed.accelerator import get_accelerator

    accelerator, calls = get_accelerator(), []
    original = accelerator.synchronize

    def synchronize(*args, **kwargs):
        calls.append("accelerator.synchronize")
        return original(*args, **kwargs)

    accelerator.synchronize = synchronize
    try:
        yield calls
    finally:
        del accelerator.synchronize  # the class's method again


class _ScalarReads(TorchDispatchMode):
    def __init__(self, reads: list):
        super().__init__()
        self.reads = reads

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _READING_OPS:
            frames = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename]
            where = f"{frames[-1].filename.split('site-packages/')[-1]}:{frames[-1].lineno}" if frames else "?"
            self.reads.append((current_host_read(), str(func), where))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def scalar_reads():
    """Records every value-dependent op (``bool()``, ``.item()``, ``nonzero``...) on ordinary tensors as
    ``(host_read name or None, op, where)``: inside code that on a GPU holds only device tensors (a DeepSpeed
    optimizer step), each is a read that stalls the stream. Where host and device tensors mix, use
    :class:`OtherDevice`, which tells them apart. ``.tolist()`` does not dispatch and is not seen."""
    reads: list[tuple[str | None, str, str]] = []
    with _ScalarReads(reads):
        yield reads
