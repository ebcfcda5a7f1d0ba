"""A weight loader for SGLang's CPU (AMX) backend, loaded *inside the SGLang server*.

SGLang 0.5.18 packs every linear weight for AMX once, after loading
(``UnquantizedLinearMethod.process_weights_after_loading`` -> ``_amx_process_weight_after_
loading``, layers/amx_utils.py): the parameter then holds the packed layout, with the same
shape and dtype as the plain one. ``update_weights_from_tensor`` and
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
"""

_DIRTY = "_homegym_repack_dirty"
_MARK = "_homegym_repack"


def _track(model) -> dict:
    """Wrap the packed modules' weight loaders and re-pack hook (once per model)."""
    dirty = getattr(model, _DIRTY, None)
    if dirty is not None:
        return dirty
    dirty = {}  # id(module) -> module whose packed parameter now holds plain values
    setattr(model, _DIRTY, dirty)
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
        for param in module.parameters(recurse=False):
            load = getattr(param, "weight_loader", None)
            if load is None or getattr(load, _MARK, False):
                continue
            def loader(*args, _load=load, _module=module, **kwargs):
                dirty[id(_module)] = _module
                return _load(*args, **kwargs)
            setattr(loader, _MARK, True)
            # The re-packed Parameter keeps the old one's __dict__, so this survives.
            param.weight_loader = loader
    return dirty


def load(model, named_tensors) -> None:
    _track(model)
    if named_tensors:
        model.load_weights(named_tensors)


def load_and_repack(model, named_tensors) -> None:
    load(model, named_tensors)
    for module in list(_track(model).values()):
        module.quant_method.process_weights_after_loading(module)
