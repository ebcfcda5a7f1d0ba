"""A weight loader for SGLang's CPU (AMX) backend, loaded *inside the SGLang server*.

SGLang 0.5.18 packs every linear weight for AMX once, after loading
(``UnquantizedLinearMethod.process_weights_after_loading`` -> ``_amx_process_weight_after_
loading``, layers/amx_utils.py): the parameter then holds the packed layout, mostly with the
same shape and dtype as the plain one (two exceptions below). ``update_weights_from_tensor`` and
``_from_distributed`` only call ``model.load_weights``, whose loaders ``copy_`` plain values
into the packed parameter, so every later forward reads garbage; only
``update_weights_from_disk`` re-packs (``load_weights_and_postprocess``).

These loaders go through SGLang's own hook (``--custom-weight-loader
homegym_sglang_cpu.load homegym_sglang_cpu.load_and_repack``, then a ``load_format`` of one
of those names): ``load`` marks each packed module a weight loader writes into and loads;
``load_and_repack`` does the same and then re-packs every marked module. A push sends its
buckets with ``load`` and ends with ``load_and_repack`` of no tensors, because re-packing
reads a whole parameter and the shards of a fused one (q/k/v -> qkv_proj, gate/up ->
gate_up_proj) may arrive in different buckets. A distributed push (its route has no loader
hook) opens with an empty ``load``, which installs the marks, and ends the same way. The
server imports this file by name (its directory is put on PYTHONPATH), so it imports
nothing of homegym.

A Gated DeltaNet layer's causal-conv weight (Qwen3.5, Qwen3-Next: ``conv1d``, a linear
layer holding an (out, 1, kernel) weight) is packed differently: the module's parameter
becomes a new (out, kernel) tensor, and the packed values are also copied into the original
storage, which the attention kernel reads (``RadixLinearAttention.conv_weights``, a view of
it). A pushed (out, 1, kernel) tensor fits neither the packed parameter's shape nor would it
reach the kernel's storage: the scheduler dies on the first push. So for such a module the
parameter is pointed back at the original storage, in its original shape, before a loader
writes into it; re-packing then packs it and copies the packed values back where the
kernel reads them, as at start-up. Likewise a linear weight with fewer than 16 outputs
(Qwen3.5's ``in_proj_ba`` on a small model) is kept transposed in float32: a loader gets a
new parameter of the plain shape and dtype, and re-packing packs it.
"""

import torch

_DIRTY = "_homegym_repack_dirty"
_MARK = "_homegym_repack"


def _track(model) -> dict:
    """Wrap the packed modules' weight loaders and re-pack hook (once per model)."""
    dirty = getattr(model, _DIRTY, None)
    if dirty is not None:
        return dirty
    dirty = {}  # id(module) -> module whose packed parameter now holds plain values
    setattr(model, _DIRTY, dirty)
    convs = _packed_convs(model)
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is None or not getattr(module, "use_intel_amx_backend", False):
            continue
        repack = method.process_weights_after_loading
        if not getattr(repack, _MARK, False):
            def process(layer, _repack=repack):
                dirty.pop(id(layer), None)  # any re-pack (also the disk path's) cleans it
                return _repack(layer)
            setattr(process, _MARK, True)
            method.process_weights_after_loading = process
        for name, param in module.named_parameters(recurse=False):
            load = getattr(param, "weight_loader", None)
            if load is None or getattr(load, _MARK, False):
                continue
            packed = name == "weight"
            conv = convs.get(id(module))
            def loader(*args, _load=load, _module=module, _packed=packed, _conv=conv, **kwargs):
                dirty[id(_module)] = _module
                if _packed:  # into a parameter of the plain layout's shape
                    args = (_plain_weight(_module, _conv),) + args[1:]
                return _load(*args, **kwargs)
            setattr(loader, _MARK, True)
            # The re-packed Parameter keeps the old one's __dict__, so this survives.
            param.weight_loader = loader
    return dirty


def _packed_convs(model) -> dict:
    """id(conv module) -> the (out, kernel) storage its attention kernel reads, for every
    Gated DeltaNet layer whose conv weight was packed (its parameter is 2-D)."""
    convs = {}
    for layer in model.modules():
        conv = getattr(layer, "conv1d", None)
        kernel_view = getattr(getattr(layer, "attn", None), "conv_weights", None)
        if (conv is not None and getattr(conv, "use_intel_amx_backend", False)
                and isinstance(kernel_view, torch.Tensor) and kernel_view.dim() == 2
                and conv.weight.dim() == 2):
            convs[id(conv)] = kernel_view
    return convs


def _plain_weight(module, kernel_view):
    """``module.weight`` in the plain layout, for a loader to write into: the parameter
    itself where packing kept its shape and dtype; else a new parameter with the old one's
    attributes (its weight loader among them), which re-packing packs again. For a packed
    conv weight that is the kernel's storage viewed as (out, 1, kernel)."""
    weight = module.weight
    if kernel_view is not None:
        if weight.dim() == 3:  # already pointed back by an earlier bucket
            return weight
        plain = kernel_view.view(kernel_view.size(0), 1, kernel_view.size(1))
    else:
        # A linear layer's (out, in) (SGLang's linear.py create_weights). Packing keeps shape
        # and dtype where the output dim is a multiple of the AMX tile's 16; below that it
        # keeps a transposed float32 copy for its FMA path (sgl-kernel cpu/gemm.cpp,
        # convert_weight_packed).
        outs = getattr(module, "output_partition_sizes", None)
        ins = getattr(module, "input_size_per_partition", getattr(module, "input_size", None))
        dtype = getattr(module, "params_dtype", weight.dtype)
        if weight.dim() != 2 or not outs or not ins or (
                weight.shape == (sum(outs), ins) and weight.dtype == dtype):
            return weight
        plain = torch.empty(sum(outs), ins, dtype=dtype)
    new = torch.nn.Parameter(plain, requires_grad=False)
    new.__dict__ = weight.__dict__
    module.weight = new
    return new


def load(model, named_tensors) -> None:
    _track(model)
    if named_tensors:
        model.load_weights(named_tensors)


def load_and_repack(model, named_tensors) -> None:
    load(model, named_tensors)
    for module in list(_track(model).values()):
        module.quant_method.process_weights_after_loading(module)
