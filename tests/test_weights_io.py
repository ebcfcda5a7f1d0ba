"""SGLang's /update_weights_from_tensor payload as homegym writes it (rollout/engines/weights_io).

The receiving side is a real second process (subprocess), as an engine server is: CPU
tensors cross through /dev/shm (file_system sharing strategy), CUDA tensors (when a GPU is
present) as IPC handles naming the device by UUID.
"""

import base64
import io
import os
import pickle
import subprocess
import sys
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from rollout.engines import weights_io as wio

WEIGHTS_IO = Path(wio.__file__).resolve()

# The receiver: loads weights_io by path (nothing else of homegym); for each line on stdin
# (a JSON request: the payload, its format, the reader, the reference tensors' file) it
# reads the payload, compares it with the reference tensors saved by the parent, and prints
# a JSON report. One process serves the module's tests (one `import torch`, not one each).
CHILD = r"""
import importlib.util, json, sys, torch
spec = importlib.util.spec_from_file_location("hg_weights_io", sys.argv[1])
wio = importlib.util.module_from_spec(spec); spec.loader.exec_module(wio)
for line in sys.stdin:
    req = json.loads(line)
    if req["reader"] == "plain":  # what the hf engine does today (MultiprocessingSerializer)
        got = wio.MultiprocessingSerializer.deserialize(req["payload"])
    else:
        got = wio.deserialize_named_tensors(req["payload"], req["fmt"])
    ref = torch.load(req["ref"])
    report = {"names": [n for n, _ in got], "bad": [], "devices": []}
    for name, tensor in got:
        want = ref[name]
        if (tensor.dtype != want.dtype or tuple(tensor.shape) != tuple(want.shape)
                or not torch.equal(tensor.cpu(), want)):
            report["bad"].append(name)
        report["devices"].append(str(tensor.device))
    del got
    print(json.dumps(report), flush=True)
"""


@pytest.fixture(scope="module")
def receiver():
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(WEIGHTS_IO)], text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    yield proc
    proc.stdin.close()
    proc.wait(timeout=60)


def _named(device="cpu"):
    g = torch.Generator().manual_seed(0)
    tensors = [
        ("model.embed_tokens.weight", torch.randn(50, 8, generator=g)),
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(8, 8, generator=g).bfloat16()),
        ("model.layers.0.mlp.gate_proj.weight", torch.randn(16, 8, generator=g).half()),
        ("model.norm.weight", torch.randn(8, generator=g)),
        ("scalar", torch.tensor(1.5, dtype=torch.float64)),
        ("ids", torch.arange(7)),
        ("flags", torch.tensor([True, False, True])),  # 3 bytes: misaligns what follows
        ("after_flags", torch.randn(5, generator=g)),
        ("transposed", torch.randn(4, 6, generator=g).t()),  # not contiguous
    ]
    return [(n, t.to(device)) for n, t in tensors]


def _received(receiver, tmp_path, named, payload, fmt, reader="homegym"):
    """The receiver's report on ``payload``, checked against ``named``."""
    import json

    ref = tmp_path / "ref.pt"
    torch.save({n: t.detach().cpu().contiguous() for n, t in named}, ref)
    receiver.stdin.write(json.dumps({"payload": payload, "fmt": fmt, "reader": reader,
                                     "ref": str(ref)}) + "\n")
    receiver.stdin.flush()
    line = receiver.stdout.readline()
    assert line, f"the receiver exited {receiver.poll()} (its traceback is above)"
    return json.loads(line)


@pytest.mark.parametrize("flattened", [False, True])
@pytest.mark.subprocess
def test_second_process_reads_cpu_payload(receiver, tmp_path, flattened):
    named = _named()
    payloads, fmt = wio.serialize_for_sglang(named, tp_size=2, flattened=flattened)
    assert len(payloads) == 2 and all(isinstance(p, str) for p in payloads)
    assert fmt == ("flattened_bucket" if flattened else None)
    for payload in payloads:  # each TP rank's entry stands alone
        report = _received(receiver, tmp_path, named, payload, fmt)
        assert report["names"] == [n for n, _ in named]
        assert report["bad"] == []


@pytest.mark.subprocess
def test_list_payload_still_reads_with_the_plain_deserializer(receiver, tmp_path):
    """The hf engine's reader (MultiprocessingSerializer.deserialize) is unchanged."""
    named = _named()
    payloads, fmt = wio.serialize_for_sglang(named, tp_size=1, flattened=False)
    report = _received(receiver, tmp_path, named, payloads[0], fmt, reader="plain")
    assert report["bad"] == [] and len(report["names"]) == len(named)


def test_cpu_serialization_is_unchanged():
    """For CPU tensors the UUID reducer changes nothing: same bytes as torch's pickler."""
    named = _named()
    ours = wio.MultiprocessingSerializer.serialize(named)
    buf = io.BytesIO()
    ForkingPickler(buf).dump(named)
    assert ours == buf.getvalue()
    assert mp.get_sharing_strategy() == "file_system"


def test_flattened_bucket_round_trip():
    named = _named()
    bucket = wio.flatten_bucket(named)
    flat = bucket["flattened_tensor"]
    assert flat.dtype == torch.uint8 and flat.dim() == 1
    ends = [0] + [m.end_idx for m in bucket["metadata"]]
    for m, (name, t), end in zip(bucket["metadata"], named, ends):
        assert (m.name, m.shape, m.dtype) == (name, t.shape, t.dtype)
        # back to back up to 16-byte alignment (a bool/odd bf16 tensor before a float32)
        assert m.start_idx % 16 == 0 and 0 <= m.start_idx - end < 16
        assert m.numel == m.end_idx - m.start_idx == t.numel() * t.element_size()
    assert flat.numel() == bucket["metadata"][-1].end_idx
    back = wio.unflatten_bucket(bucket)
    assert [n for n, _ in back] == [n for n, _ in named]
    for (_, a), (_, b) in zip(named, back):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    empty = wio.flatten_bucket([])
    assert empty["flattened_tensor"].numel() == 0 and wio.unflatten_bucket(empty) == []


def _globals(payload: str) -> set[str]:
    """Module-qualified globals a pickle loads (what SGLang's SafeUnpickler checks)."""
    seen = set()

    class Recorder(pickle.Unpickler):
        def find_class(self, module, name):
            seen.add(f"{module}.{name}")
            return super().find_class(module, name)

    mp.set_sharing_strategy("file_system")
    Recorder(io.BytesIO(base64.b64decode(payload))).load()
    return seen


@pytest.mark.parametrize("flattened", [False, True])
def test_payload_names_only_torch_and_builtins(flattened):
    """No homegym (or sglang) class in the pickle: SGLang's SafeUnpickler admits only its
    allowlist, and homegym cannot pickle SGLang's own classes without sglang installed."""
    payloads, _ = wio.serialize_for_sglang(_named(), tp_size=1, flattened=flattened)
    names = _globals(payloads[0])
    assert names, "expected some globals"
    assert all(n.startswith(("torch.", "builtins.", "types.", "collections.", "copyreg."))
               for n in names), names
    assert ("types.SimpleNamespace" in names) == flattened


class _Foreign:
    pass


def test_reader_refuses_foreign_globals():
    payload = base64.b64encode(pickle.dumps([("w", _Foreign())])).decode()
    with pytest.raises(pickle.UnpicklingError, match="refusing"):
        wio.deserialize_named_tensors(payload)
    with pytest.raises(ValueError, match="load_format"):
        wio.deserialize_named_tensors(wio.serialize_for_sglang(_named())[0][0], "bogus")


def test_uuid_rebuild_keeps_torchs_name(monkeypatch):
    """The receiver patch (installed on deserialize) maps UUIDs to local indices and still
    pickles as torch.multiprocessing.reductions.rebuild_cuda_tensor."""
    from torch.multiprocessing import reductions

    original = reductions.rebuild_cuda_tensor
    original = getattr(original, "_homegym_original", original)  # an earlier test installed it
    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", original)
    wio.install_cuda_uuid_rebuild()
    wio.install_cuda_uuid_rebuild()  # idempotent
    patched = reductions.rebuild_cuda_tensor
    assert patched is not original and patched._homegym_uuid
    assert pickle.loads(pickle.dumps(patched)) is patched  # by reference, torch's name
    assert b"torch.multiprocessing.reductions" in pickle.dumps(patched)
    assert wio._device_from_uuid(3) == 3
    with pytest.raises(RuntimeError, match="not visible"):
        wio._device_from_uuid("GPU-00000000-not-a-device")


class _FakeCudaTensor:
    """Stands in for a CUDA tensor (no GPU here): reduces the way torch's reduce_tensor
    does for one, with the device index as argument 6."""

    device = type("Device", (), {"type": "cuda"})()


def _fake_reduce(tensor):
    from torch.multiprocessing import reductions

    return reductions.rebuild_cuda_tensor, tuple(range(6)) + (1,) + tuple(range(7, 15))


def test_cuda_handles_name_the_device_by_uuid(monkeypatch):
    """Sender: argument 6 becomes the device UUID and the rebuild function is pickled
    under torch's name (what SGLang's patched receiver looks up). Receiver: the UUID maps
    back to the local index of that device."""
    uuids = ["GPU-aaaa", "GPU-bbbb"]
    monkeypatch.setattr(wio, "_device_uuid", lambda index: uuids[index])
    monkeypatch.setattr(wio, "_tensor_reducers", lambda: [_FakeCudaTensor])
    buf = io.BytesIO()
    pickler = ForkingPickler(buf)
    pickler.dispatch_table[_FakeCudaTensor] = _fake_reduce
    wio._use_device_uuids(pickler)
    wio._use_device_uuids(pickler)  # wrapping twice changes nothing
    pickler.dump(_FakeCudaTensor())
    seen = {}

    class Capture(pickle.Unpickler):
        def find_class(self, module, name):
            seen["global"] = f"{module}.{name}"
            return lambda *args: args

    args = Capture(io.BytesIO(buf.getvalue())).load()
    assert seen["global"] == "torch.multiprocessing.reductions.rebuild_cuda_tensor"
    assert args[6] == "GPU-bbbb" and args[:6] == tuple(range(6)) and len(args) == 15
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert wio._device_from_uuid("GPU-bbbb") == 1
    assert wio._device_from_uuid(0) == 0


def test_rejects_bad_tp_size():
    with pytest.raises(ValueError, match="tp_size"):
        wio.serialize_for_sglang(_named(), tp_size=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("flattened", [False, True])
def test_second_process_opens_cuda_ipc_by_uuid(receiver, tmp_path, flattened):
    named = _named("cuda")
    payloads, fmt = wio.serialize_for_sglang(named, tp_size=1, flattened=flattened)
    uuid = str(torch.cuda.get_device_properties(0).uuid)
    assert uuid.encode() in base64.b64decode(payloads[0])  # the device by UUID, not index
    report = _received(receiver, tmp_path, named, payloads[0], fmt)
    assert report["bad"] == [] and all(d.startswith("cuda") for d in report["devices"])



@pytest.mark.subprocess
def test_staged_buckets_reuse_their_shared_buffer_and_carry_new_values(receiver, tmp_path):
    """SharedStaging: a second push of the same layout writes into the same /dev/shm
    buffer, and a second process reads the new values (not the first push's)."""
    staging = wio.SharedStaging()
    named = _named()
    first = staging.flatten(0, named)
    flat = first["flattened_tensor"]
    assert flat.is_shared()
    payload = wio.MultiprocessingSerializer.serialize(first, output_str=True)
    report = _received(receiver, tmp_path, named, payload, "flattened_bucket")
    assert report["bad"] == [] and report["names"] == [n for n, _ in named]

    changed = [(n, t + 1 if t.dtype != torch.bool else ~t) for n, t in named]
    second = staging.flatten(0, changed)
    assert second["flattened_tensor"].data_ptr() == flat.data_ptr()  # no new shared copy
    payload = wio.MultiprocessingSerializer.serialize(second, output_str=True)
    report = _received(receiver, tmp_path, changed, payload, "flattened_bucket")
    assert report["bad"] == []
    # Another layout under the same key gets its own buffer.
    other = staging.flatten(0, changed[:3])
    assert [m.name for m in other["metadata"]] == [n for n, _ in changed[:3]]
