"""Megatron-core training backend (TP/PP/DP, sequence parallel, distributed optimizer).

One instance per training rank, inside ``TrainActor`` (torch.distributed is initialised
by it over all ranks; Megatron's TP/PP/CP/DP/EP groups are carved out of that here).

Shared with the FSDP backend, not duplicated: batching and data-parallel sharding
(``trainer.training.backends.batching``, with the DP rank/size instead of the global ones), the
loss of a micro-batch (``trainer.training.algo.objective``), the train/SFT step loop and advantages
(``trainer.training.backends.rl_step``, this class supplies its hooks; the whitening all-reduce is
over all ranks, and the identical copies on TP/PP replicas scale every moment alike, so
mean and std are unchanged) and the LR schedule. Megatron-specific: the model, the
pipeline schedule, vocab-parallel log-probs, the HF weight map, the optimizer and the
checkpoint format.

Micro-batches: on GPU with Transformer Engine, each micro-batch's samples are packed into
one row (THD, ``PackedSeqParams`` with cu_seqlens, no padding); with the local layer spec
(CPU, or no TE) samples are right-padded rows with a causal mask, which is exact for the
real tokens (padding only ever follows them).

Without Transformer Engine on CUDA the local spec runs with the fusions that need apex or
TE turned off (``model.kernel_plan``, one warning line); ``train.sequence_parallel`` then
is refused at init. Collectives put their tensors where the group's backend wants them
(``collective_device``: the current CUDA device under NCCL, CPU under gloo). ``offload``
frees everything the rank holds on its device (``offload.StateOffloader``).

On CPU, ``cpu_shim`` patches torch.cuda so megatron-core runs; that path is for testing
and debugging only.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from trainer.training.backends.base import NamedTensors, bucketed
from trainer.training.backends.batching import (
    BatchLike, MicroBatch, build_micro_batch, check_batch, plan_step)
from rollout.modeling.hybrid import transfer_dtype
from trainer.training.backends.megatron import hf_map
from trainer.training.backends.rl_step import StepLoop, per_sample_log_probs

log = logging.getLogger("homegym.megatron")


def device_for_backend(backend: str) -> str:
    """``"cuda"`` or ``"cpu"``: where a collective's tensors must live for a process group
    of this torch.distributed backend. NCCL reduces only CUDA tensors; gloo (and MPI)
    reduce CPU tensors; a multi-device group (``"cpu:gloo,cuda:nccl"``) takes CPU ones."""
    name = str(backend).lower()
    if ":" in name:
        devices = {part.split(":")[0].strip() for part in name.split(",")}
        return "cpu" if "cpu" in devices else "cuda"
    return "cuda" if name == "nccl" else "cpu"


def collective_device(group=None) -> torch.device:
    """The device of tensors handed to collectives on ``group`` (None: the world group)."""
    if device_for_backend(dist.get_backend(group)) == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_metric_sums(sums: dict, keys, *, contributes: bool, group=None) -> dict[str, float]:
    """Sum over ``group``'s ranks of each metric in ``keys`` (a rank that does not
    contribute sends zeros). Every rank must pass the same ``keys``. The vector is built
    and reduced on the group's device (``collective_device``)."""
    keys = sorted(keys)
    device = collective_device(group)
    values = [torch.as_tensor(sums[k] if (contributes and k in sums) else 0.0).detach()
              .to(device=device, dtype=torch.float64).reshape(()) for k in keys]
    flat = torch.stack(values) if values else torch.zeros(0, dtype=torch.float64, device=device)
    dist.all_reduce(flat, group=group)
    return dict(zip(keys, flat.cpu().tolist()))


class MegatronBackend(StepLoop):
    """One training rank. Call ``init`` after ``torch.distributed`` is initialised."""

    # ----------------------------------------------------------------- setup
    def init(self, model, train, algo, warmup, cluster, *, rank: int, world_size: int,
             share_prompts: bool, total_optimizer_steps: int) -> None:
        """``share_prompts`` is always false here (config validation: FSDP only)."""
        torch.set_num_threads(cluster.torch_threads)
        self.train, self.algo, self.warmup = train, algo, warmup
        self.rank, self.world_size = rank, world_size
        self.cpu = cluster.device != "cuda" or not torch.cuda.is_available()
        if self.cpu:
            from trainer.training.backends.megatron import cpu_shim

            cpu_shim.apply_if_needed()
            # megatron-core's jit_fuser is torch.compile: on CPU, inductor would compile its
            # elementwise helpers (Qwen3.5's attention output gate) with the C++ compiler,
            # in every process and for every new shape, and buy nothing at these sizes
            # (the cost is measured in docs/testing.md). CUDA keeps the compile.
            torch.compiler.set_stance("force_eager")
            self.device = torch.device("cpu")
        else:
            torch.cuda.set_device(0)  # Ray exposes this rank's GPU as device 0
            self.device = torch.device("cuda", 0)

        from megatron.core import parallel_state as ps
        from transformers import AutoConfig

        from trainer.training.backends.megatron import model as M
        from rollout.models import resolve_model_path

        path = resolve_model_path(model.path, model.cache_dir)
        # A vision-language checkpoint (Qwen3.5): its text model is what trains.
        self.hf = AutoConfig.from_pretrained(path).get_text_config()
        # Layer spec and fused kernels: decided (and sequence_parallel refused without TE)
        # before any process group or model exists. Qwen3.5's layers are built on the
        # local spec (trainer/training/backends/megatron/hybrid.py).
        self.kernels = M.kernel_plan(device="cpu" if self.cpu else "cuda",
                                     te_available=M.have_transformer_engine()
                                     and not hf_map.is_qwen3_5(self.hf),
                                     fused_softmax_available=M.have_apex_fused_softmax(),
                                     sequence_parallel=train.sequence_parallel)
        if self.kernels.note and rank == 0:
            log.warning(self.kernels.note)
        if train.context_parallel_size > 1:
            raise NotImplementedError(
                "train.context_parallel_size > 1: the THD sequence split across CP ranks is "
                "not implemented yet in the megatron backend")
        torch.manual_seed(train.seed)
        M.initialize_parallel(train, seed=train.seed)
        self.ps = ps
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.tp_size = ps.get_tensor_model_parallel_world_size()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.pp_size = ps.get_pipeline_model_parallel_world_size()
        self.dp_rank = ps.get_data_parallel_rank()
        self.dp_size = ps.get_data_parallel_world_size()
        self.is_last = ps.is_pipeline_last_stage()
        self.use_te = self.kernels.use_te
        self.packed = self.kernels.packed  # THD packing needs TE's attention

        self.model_path = path
        self.vocab_size = self.hf.vocab_size
        self.padded_vocab = hf_map.padded_vocab_size(
            self.vocab_size, M.vocab_multiple(self.tp_size, self.cpu))
        self.tconfig = M.transformer_config(self.hf, train, dtype=model.dtype, cpu=self.cpu,
                                            fusions=self.kernels.fusions)
        # Exported weights (weight sync, HF export) are in the dtype the model trains in
        # (Float16Module casts the module itself to it; fp32 main params stay internal).
        self.export_dtype = (torch.bfloat16 if self.tconfig.bf16 else
                             torch.float16 if self.tconfig.fp16 else torch.float32)
        self.ckpt = M.HFCheckpoint(path)
        self.pad_token_id = getattr(self.hf, "pad_token_id", None) or 0

        self.gpt = self._build(trainable=True)
        self.ref = self._build(trainable=False) if algo.kl_coef > 0 else None
        self._hf_layout = self._export_layout()

        from megatron.core.distributed import (
            DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads)
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False,
            use_distributed_optimizer=train.use_distributed_optimizer)
        self.model = DistributedDataParallel(config=self.tconfig, ddp_config=ddp_config,
                                             module=self._wrap16(self.gpt))
        opt_config = OptimizerConfig(
            optimizer="adam", lr=train.lr, min_lr=train.min_lr, weight_decay=train.weight_decay,
            adam_beta1=train.adam_beta1, adam_beta2=train.adam_beta2,
            clip_grad=train.grad_clip or 1e30,  # always compute the norm (it is a metric)
            bf16=self.tconfig.bf16, fp16=self.tconfig.fp16, params_dtype=torch.float32,
            use_distributed_optimizer=train.use_distributed_optimizer)
        self.optimizer = get_megatron_optimizer(opt_config, [self.model])
        self.tconfig.no_sync_func = self.model.no_sync
        self.tconfig.finalize_model_grads_func = finalize_model_grads
        if self.tconfig.fp16:
            self.tconfig.grad_scale_func = self.optimizer.scale_loss
        self.optimizer_steps = 0
        self.sft_steps = 0
        self.total_optimizer_steps = total_optimizer_steps
        from trainer.training.backends.megatron.offload import StateOffloader

        self.offloader = StateOffloader(self.device, pin=not self.cpu)
        self.last_offload: Optional[dict] = None  # bytes moved, allocated before/after

    def _build(self, *, trainable: bool):
        from trainer.training.backends.megatron import model as M

        gpt = M.build_gpt(self.hf, self.tconfig, use_te=self.use_te, padded_vocab=self.padded_vocab)
        gpt.to(self.device)
        M.freeze_padding_embedding(gpt, getattr(self.hf, "pad_token_id", None))
        M.load_hf_weights(gpt, self.hf, self.ckpt, te_names=self.use_te,
                          padded_vocab=self.padded_vocab)
        if not trainable:
            gpt.requires_grad_(False)
            gpt.eval()
            return self._wrap16(gpt)
        return gpt

    def _wrap16(self, gpt):
        if self.tconfig.bf16 or self.tconfig.fp16:
            from megatron.core.transformer.module import Float16Module

            wrapped = Float16Module(self.tconfig, gpt)
            if hf_map.is_qwen3_5(self.hf):  # Float16Module cast every parameter
                from trainer.training.backends.megatron.hybrid import restore_fp32

                from trainer.training.backends.megatron import model as M

                restore_fp32(gpt, self.ckpt, M.layer_offset(gpt))
            return wrapped
        return gpt

    # ----------------------------------------------------------------- forward passes
    def _inputs(self, mb: MicroBatch) -> tuple[dict, torch.Tensor, torch.Tensor]:
        """Model kwargs plus (row, col) into the logits of each flat response token."""
        mb_ids = mb.input_ids
        if not self.packed:
            b, t = mb_ids.shape
            if self.train.sequence_parallel and t % self.tp_size:
                extra = self.tp_size - t % self.tp_size
                mb_ids = torch.cat([mb_ids, mb_ids.new_full((b, extra), self.pad_token_id)], 1)
                t += extra
            position_ids = torch.arange(t)[None, :].expand(b, -1)
            kwargs = dict(input_ids=mb_ids.to(self.device),
                          position_ids=position_ids.to(self.device), attention_mask=None)
            return kwargs, mb.row_idx, mb.col_idx
        from megatron.core.packed_seq_params import PackedSeqParams

        lengths = mb.attention_mask.sum(1)
        tokens = mb_ids[mb.attention_mask.bool()]
        pad_to = self.tp_size * 2 if self.train.sequence_parallel else 1
        extra = (-tokens.numel()) % pad_to
        seqlens = lengths.tolist() + ([extra] if extra else [])
        if extra:
            tokens = torch.cat([tokens, tokens.new_full((extra,), self.pad_token_id)])
        cu = torch.zeros(len(seqlens) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(torch.tensor(seqlens), 0)
        position_ids = torch.cat([torch.arange(n) for n in seqlens])
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu.to(self.device),
                                 cu_seqlens_kv=cu.to(self.device),
                                 max_seqlen_q=max(seqlens), max_seqlen_kv=max(seqlens))
        kwargs = dict(input_ids=tokens[None].to(self.device),
                      position_ids=position_ids[None].to(self.device), attention_mask=None,
                      packed_seq_params=params)
        col = cu[:-1].long()[mb.row_idx] + mb.col_idx
        return kwargs, torch.zeros_like(col), col

    def _token_log_probs(self, logits, mb, row, col, *, with_entropy, entropy_grad=False):
        from trainer.training.backends.megatron.model import vocab_parallel_log_probs

        selected = logits[row.to(self.device), col.to(self.device)]
        return vocab_parallel_log_probs(selected, mb.targets.to(self.device),
                                        vocab_size=self.vocab_size, with_entropy=with_entropy,
                                        entropy_grad=entropy_grad)

    def _run(self, model, mbs: list[MicroBatch], loss_fn, *, forward_only: bool) -> None:
        """Megatron's pipeline schedule over ``mbs``; ``loss_fn(k, mb, logits)`` -> loss
        (called on the last stage only, in micro-batch order)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        prepared = [(k, mb) + self._inputs(mb) for k, mb in enumerate(mbs)]
        n = len(mbs)
        # The schedule divides each loss by the micro-batch count and DDP averages
        # gradients over DP ranks; objective.py's losses are already normalised by the
        # step's global counts, so undo both to get the plain sum.
        scale = float(n * self.dp_size)

        def forward_step(data_iterator, model):
            k, mb, kwargs, row, col = next(data_iterator)
            output = model(**kwargs)

            def loss_func(output_tensor):
                loss = loss_fn(k, mb, output_tensor, row, col)
                return loss * scale, {}
            return output, loss_func

        seq = max(p[2]["input_ids"].shape[1] for p in prepared)
        mbs_size = max(p[2]["input_ids"].shape[0] for p in prepared)
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(prepared), model=[model],
            num_microbatches=n, seq_length=seq, micro_batch_size=mbs_size,
            forward_only=forward_only)

    def _forward_log_probs(self, model, mbs: list[MicroBatch]) -> list[torch.Tensor]:
        """Per micro-batch flat log-probs, on EVERY rank (sent from the last stage)."""
        out: dict[int, torch.Tensor] = {}

        def loss_fn(k, mb, logits, row, col):
            logp, _ = self._token_log_probs(logits, mb, row, col, with_entropy=False)
            out[k] = logp.detach().float().cpu()
            return logp.sum() * 0.0

        model.eval()
        with torch.no_grad():
            self._run(model, mbs, loss_fn, forward_only=True)
        return self._from_last_stage(out, len(mbs))

    def _from_last_stage(self, out: dict[int, torch.Tensor], n: int) -> list[torch.Tensor]:
        if self.pp_size == 1:
            return [out[k].to(self.device) for k in range(n)]
        group = self.ps.get_pipeline_model_parallel_group()
        obj = [out if self.is_last else None]
        dist.broadcast_object_list(obj, src=dist.get_global_rank(group, self.pp_size - 1),
                                   group=group)
        return [obj[0][k].to(self.device) for k in range(n)]

    def _plan(self, batch: BatchLike, global_batch_size: Optional[int], skip=frozenset()):
        return plan_step(batch, rank=self.dp_rank, world_size=self.dp_size,
                         global_batch_size=global_batch_size,
                         max_tokens=self.train.max_tokens_per_micro_batch, skip=skip)

    def log_probs(self, batch: BatchLike) -> list[torch.Tensor]:
        check_batch(batch)
        self._ensure_onloaded()
        mbs = [self._micro_batch(batch, ids) for ids in self._plan(batch, None)[0]]
        lps = self._forward_log_probs(self.model, mbs)
        return per_sample_log_probs(mbs, lps, num_samples=len(batch.tokens),
                                    contribute=self._owns_outputs())

    # ----------------------------------------------------------------- training
    # StepLoop's hooks; the loop itself is trainer.training.backends.rl_step.
    def _begin_step(self) -> None:
        self._ensure_onloaded()

    def _micro_batch(self, batch: BatchLike, sample_ids: list[int]) -> MicroBatch:
        return build_micro_batch(batch, sample_ids, pad_token_id=self.pad_token_id,
                                 dedupe=self.train.dedupe_samples)

    def _ref_log_probs(self, mbs: list[MicroBatch]) -> Optional[list[torch.Tensor]]:
        return self._forward_log_probs(self.ref, mbs) if self.ref is not None else None

    def _policy_log_probs(self, mbs: list[MicroBatch]) -> list[torch.Tensor]:
        return self._forward_log_probs(self.model, mbs)

    def _accumulate(self, mbs: list[MicroBatch], loss_of, *, with_entropy: bool,
                    entropy_grad: bool = False) -> None:
        def loss_fn(j, mb, logits, row, col):
            logp, entropy = self._token_log_probs(logits, mb, row, col, with_entropy=with_entropy,
                                                  entropy_grad=entropy_grad)
            return loss_of(j, mb, logp, entropy)

        self.model.train()
        self._zero_grad()
        self._run(self.model, mbs, loss_fn, forward_only=False)

    def _optimizer_step(self) -> float:
        ok, grad_norm, _ = self.optimizer.step()
        if not ok:
            raise RuntimeError("megatron optimizer step was skipped (inf/nan gradients)")
        return float(grad_norm) if grad_norm is not None else 0.0

    def _zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def _all_reduce_metrics(self, sums: dict[str, torch.Tensor], keys) -> dict[str, float]:
        """Sum over DP ranks of the last stage's metrics (TP ranks hold identical copies).
        Every rank reduces the vector of all ``keys``, also stages that compute no loss."""
        unknown = set(sums) - set(keys)
        if unknown:  # every rank must all-reduce the same vector: keep the list complete
            raise RuntimeError(f"metrics {sorted(unknown)} missing from the step's metric keys")
        return all_reduce_metric_sums(sums, keys, contributes=self._owns_outputs())

    def _owns_outputs(self) -> bool:
        return self.is_last and self.tp_rank == 0

    # ----------------------------------------------------------------- weights
    def _export_layout(self) -> list[tuple[int, str]]:
        """(owning pipeline stage, Megatron global name) of every exported tensor, in HF
        checkpoint order; identical on all ranks."""
        from megatron.core.transformer.transformer_block import get_num_layers_to_build
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

        # Layer ranges of all stages, gathered (each stage knows only its own).
        offset = get_transformer_layer_offset(self.tconfig)
        count = get_num_layers_to_build(self.tconfig)
        mine = (self.pp_rank, offset, count)
        stages: list = [None] * self.world_size
        dist.all_gather_object(stages, mine)
        ranges = {s: (o, c) for s, o, c in stages}
        layout = []
        for s in range(self.pp_size):
            o, c = ranges[s]
            names = hf_map.megatron_names(self.hf, te_names=self.use_te, layers=range(o, o + c),
                                          pre_process=s == 0, post_process=s == self.pp_size - 1)
            layout += [(s, n) for n in names]
        # HF order: embedding, layers, norm, lm_head (stage order already gives it).
        return layout

    def named_weight_buckets(self, bucket_bytes: int, device: str = "cpu",
                             dtype=None) -> Iterator[NamedTensors]:
        """Full HF-named tensors (TP shards gathered, PP stages broadcast) in ~bucket_bytes
        buckets, on every rank, as copies on ``device`` in the training dtype
        (``model.dtype``: bf16 when the model trains in bf16, fp32 when it is fp32).
        Works while offloaded (reads the host copies). ``dtype`` is not used: the tensors
        already travel in the training dtype, and the sender casts. Collective: every
        rank must drain the iterator."""
        yield from bucketed(self._hf_tensors(device), bucket_bytes)

    def _hf_tensors(self, device: str) -> Iterator[tuple[str, torch.Tensor]]:
        """Every full HF-named tensor in export order, on ``device`` (collective)."""
        from trainer.training.backends.megatron import model as M

        params = dict(self.gpt.named_parameters())
        offset = M.layer_offset(self.gpt)
        local = {hf_map.global_name(n, offset): p for n, p in params.items()}
        tied = bool(self.hf.tie_word_embeddings)
        pp_group = self.ps.get_pipeline_model_parallel_group()
        tp_device = collective_device(self.ps.get_tensor_model_parallel_group())
        # PP stages send their tensors as pickled CPU tensors (broadcast_object_list).
        stage_device = "cpu" if self.pp_size > 1 else device
        for stage, name in self._hf_layout:
            if stage == self.pp_rank:
                # Offloaded (weights are pushed to colocated engines after `offload`): the
                # host copy; a TP gather moves one shard at a time to the TP group's device.
                shard = self.offloader.host_view(local[name].detach())
                if self.tp_size > 1 and hf_map.tp_split_dim(name) is not None:
                    shard = shard.to(tp_device)
                full = M.gather_tp(name, shard)
                pairs = hf_map.to_hf(self.hf, name, full, te_names=self.use_te, tied=tied)
                pairs = [(n, t.to(stage_device, dtype=transfer_dtype(n, self.export_dtype),
                                  copy=True).contiguous())
                         for n, t in pairs]
            else:
                pairs = None
            if self.pp_size > 1:
                obj = [pairs]
                dist.broadcast_object_list(obj, src=dist.get_global_rank(pp_group, stage),
                                           group=pp_group)
                pairs = [(n, t.to(device)) for n, t in obj[0]]
            yield from pairs

    # ----------------------------------------------------------------- checkpoints
    def _optimizers(self) -> list:
        return list(getattr(self.optimizer, "chained_optimizers", None) or [self.optimizer])

    def save(self, path: str) -> None:
        """Per-rank files: model shard, this rank's optimizer shard, counters and RNG.
        Reloading needs the same (TP, PP, DP) layout; HF export is the portable format."""
        os.makedirs(path, exist_ok=True)
        host = self._host_copy  # works offloaded too (reads the host copies)
        state = {"model": host(self.gpt.state_dict()), "optimizer_steps": self.optimizer_steps,
                 "sft_steps": self.sft_steps, "cpu_rng": torch.get_rng_state(),
                 "layout": (self.tp_size, self.pp_size, self.dp_size)}
        # Per rank, the inner torch optimizer over this rank's main-parameter shards: its
        # state_dict (Adam moments, steps) plus the main parameters themselves (fp32
        # copies under bf16; views of the model's buffer under fp32). megatron-core's own
        # dp-reshardable save/load pair does not round-trip in 0.16.1 without apex/TE.
        opts = []
        for opt in self._optimizers():
            inner = opt.optimizer
            mains = [host(p.detach()) for g in inner.param_groups for p in g["params"]]
            opts.append({"inner": host(inner.state_dict()), "main_params": mains})
        state["optimizers"] = opts
        torch.save(state, os.path.join(path, f"megatron_rank{self.rank}.pt"))
        dist.barrier()

    def _host_copy(self, obj):
        """``obj`` (nested dicts/lists of tensors) with every tensor as a CPU copy; while
        offloaded, read from the offloaded bytes."""
        if isinstance(obj, torch.Tensor):
            return self.offloader.host_view(obj).detach().to("cpu", copy=True)
        if isinstance(obj, dict):
            out = {k: self._host_copy(v) for k, v in obj.items()}
            if isinstance(obj, OrderedDict):  # a module state_dict: keep its _metadata
                out = OrderedDict(out)
                if hasattr(obj, "_metadata"):
                    out._metadata = obj._metadata
            return out
        if type(obj) in (list, tuple):
            return type(obj)(self._host_copy(v) for v in obj)
        return obj

    def load(self, path: str) -> None:
        if self.offloader.offloaded:  # restore into device memory, then give it back
            self.onload()
            try:
                self._load(path)
            finally:
                self.offload()
            return
        self._load(path)

    def _load(self, path: str) -> None:
        file = os.path.join(path, f"megatron_rank{self.rank}.pt")
        if not os.path.exists(file):
            raise ValueError(f"{path!r} is not a Megatron checkpoint directory (no {file})")
        state = torch.load(file, weights_only=False)
        layout = (self.tp_size, self.pp_size, self.dp_size)
        if tuple(state["layout"]) != layout:
            raise ValueError(f"checkpoint was saved with (TP, PP, DP) = {state['layout']}, "
                             f"this run has {layout}")
        self.gpt.load_state_dict(state["model"], strict=True)
        for opt, entry in zip(self._optimizers(), state["optimizers"]):
            inner = opt.optimizer
            # Own copies: torch.optim keeps loaded tensors that already have the param's
            # device/dtype as they are, and torch.load's CPU storages cannot be resized
            # (offload frees storages by resizing them).
            inner.load_state_dict(self._host_copy(entry["inner"]))
            mains = [p for g in inner.param_groups for p in g["params"]]
            with torch.no_grad():
                for p, saved in zip(mains, entry["main_params"], strict=True):
                    p.copy_(saved)
            if hasattr(opt, "_copy_main_params_to_model_params"):
                opt._copy_main_params_to_model_params()  # bf16/fp16 model copies
        self.optimizer_steps, self.sft_steps = state["optimizer_steps"], state["sft_steps"]
        torch.set_rng_state(state["cpu_rng"])
        dist.barrier()

    # ----------------------------------------------------------------- memory
    def _offload_roots(self) -> list:
        """Everything this rank holds on its device: the DDP-wrapped policy (parameters,
        DDP's contiguous param/grad buffers and their bucket views, main_grad), the frozen
        reference, and the optimizer(s) (fp32 main params, Adam moments, scaler state)."""
        return [r for r in (self.model, self.gpt, self.ref, self.optimizer) if r is not None]

    def offload(self) -> None:
        """Move everything this rank holds on its device to host memory (pinned on CUDA),
        storage by storage so Megatron's views stay valid (``offload.StateOffloader``);
        gradients are dropped (they come back zeroed; every step zeroes them first). While
        offloaded, ``named_weight_buckets`` and ``save`` read the host copies; ``load``
        and the training/forward methods onload first. On CPU the same code runs (the
        host copy is ordinary memory: it frees nothing overall, it keeps the path tested)."""
        if self.offloader.offloaded:
            return
        before = self._allocated()
        self._drop_caches()
        freed = self.offloader.offload(self._offload_roots())
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.last_offload = {"offloaded_bytes": freed, "allocated_before": before,
                             "allocated_after": self._allocated()}
        log.info("megatron rank %d offload: %.2f GiB of state to host; allocated %.2f -> "
                 "%.2f GiB", self.rank, freed / 2**30, before / 2**30,
                 self.last_offload["allocated_after"] / 2**30)

    def onload(self) -> None:
        self.offloader.onload()

    def _ensure_onloaded(self) -> None:
        if self.offloader.offloaded:
            log.warning("megatron rank %d: called while offloaded; onloading first", self.rank)
            self.onload()

    def _allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0

    @staticmethod
    def _drop_caches() -> None:
        """Device tensors megatron-core caches outside the model: RoPE tables (an
        ``lru_cache`` on ``RotaryEmbedding.forward``, one per sequence length seen,
        models/common/embeddings/rotary_pos_embedding.py) and the global all-gather buffer
        (parallel_state.get_global_memory_buffer, used by sequence parallelism). Both are
        rebuilt on demand."""
        from megatron.core import parallel_state
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

        RotaryEmbedding.forward.cache_clear()
        try:
            parallel_state.get_global_memory_buffer().buffer.clear()
        except AssertionError:  # not initialised
            pass
