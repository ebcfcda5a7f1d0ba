"""Megatron-core training backend (TP/PP/DP, sequence parallel, distributed optimizer).

One instance per training rank, inside ``TrainActor`` (torch.distributed is initialised
by it over all ranks; Megatron's TP/PP/CP/DP/EP groups are carved out of that here).

Shared with the FSDP backend, not duplicated: batching and data-parallel sharding
(``trainer.backends.batching``, with the DP rank/size instead of the global ones), the
loss of a micro-batch (``trainer.algo.objective``), advantages (``trainer.backends.rl_step``
is reused as-is; its whitening all-reduce is over all ranks, and the identical copies on
TP/PP replicas scale every moment alike, so mean and std are unchanged) and the LR
schedule. Megatron-specific: the model, the pipeline schedule, vocab-parallel log-probs,
the HF weight map, the optimizer and the checkpoint format.

Micro-batches: on GPU with Transformer Engine, each micro-batch's samples are packed into
one row (THD, ``PackedSeqParams`` with cu_seqlens, no padding); with the local layer spec
(CPU, or no TE) samples are right-padded rows with a causal mask, which is exact for the
real tokens (padding only ever follows them).

On CPU, ``cpu_shim`` patches torch.cuda so megatron-core runs; that path is for testing
and debugging only.
"""

from __future__ import annotations

import os
import time
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from trainer.algo.objective import TokenInputs, policy_objective, sft_objective
from trainer.backends.base import NamedTensors
from trainer.backends.batching import (
    BatchLike, MicroBatch, build_micro_batch, check_batch, minibatch_ranges, plan_step,
    step_norms)
from trainer.backends.megatron import hf_map
from trainer.backends.rl_step import (
    micro_batch_advantages, per_sample_log_probs, train_step_metrics)
from trainer.backends.schedule import lr_at


class MegatronBackend:
    """One training rank. Call ``init`` after ``torch.distributed`` is initialised."""

    # ----------------------------------------------------------------- setup
    def init(self, config, rank: int, world_size: int) -> None:
        torch.set_num_threads(config.cluster.torch_threads)
        self.config = config
        self.rank, self.world_size = rank, world_size
        self.cpu = config.cluster.device != "cuda" or not torch.cuda.is_available()
        if self.cpu:
            from trainer.backends.megatron import cpu_shim

            cpu_shim.apply_if_needed()
            self.device = torch.device("cpu")
        else:
            torch.cuda.set_device(0)  # Ray exposes this rank's GPU as device 0
            self.device = torch.device("cuda", 0)

        from megatron.core import parallel_state as ps
        from transformers import AutoConfig

        from trainer.backends.megatron import model as M
        from trainer.models import resolve_model_path

        train = config.train
        if train.sequence_parallel and self.cpu:
            raise ValueError("train.sequence_parallel needs Transformer Engine (GPU); "
                             "megatron-core's local layer norm does not support it")
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
        self.use_te = M.have_transformer_engine() and not self.cpu
        self.packed = self.use_te  # THD packing needs TE's attention

        path = resolve_model_path(config.model.path, config.model.cache_dir)
        self.model_path = path
        self.hf = AutoConfig.from_pretrained(path)
        self.vocab_size = self.hf.vocab_size
        self.padded_vocab = hf_map.padded_vocab_size(
            self.vocab_size, M.vocab_multiple(self.tp_size, self.cpu))
        self.tconfig = M.transformer_config(self.hf, train, dtype=config.model.dtype, cpu=self.cpu)
        self.ckpt = M.HFCheckpoint(path)
        self.pad_token_id = getattr(self.hf, "pad_token_id", None) or 0

        self.gpt = self._build(trainable=True)
        self.ref = self._build(trainable=False) if config.algo.kl_coef > 0 else None
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
        samples = config.rollout.rollout_batch_size * config.rollout.n_samples_per_prompt
        per_rollout = samples // (train.global_batch_size or samples)
        self.total_optimizer_steps = max(train.num_steps * per_rollout, 1)

    def _build(self, *, trainable: bool):
        from trainer.backends.megatron import model as M

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

            return Float16Module(self.tconfig, gpt)
        return gpt

    # ----------------------------------------------------------------- forward passes
    def _inputs(self, mb: MicroBatch) -> tuple[dict, torch.Tensor, torch.Tensor]:
        """Model kwargs plus (row, col) into the logits of each flat response token."""
        mb_ids = mb.input_ids
        if not self.packed:
            b, t = mb_ids.shape
            if self.config.train.sequence_parallel and t % self.tp_size:
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
        pad_to = self.tp_size * 2 if self.config.train.sequence_parallel else 1
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
        from trainer.backends.megatron.model import vocab_parallel_log_probs

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

    def _plan(self, batch: BatchLike, global_batch_size: Optional[int]):
        return plan_step(batch, rank=self.dp_rank, world_size=self.dp_size,
                         global_batch_size=global_batch_size,
                         max_tokens=self.config.train.max_tokens_per_micro_batch)

    def log_probs(self, batch: BatchLike) -> list[torch.Tensor]:
        check_batch(batch)
        plan = self._plan(batch, None)[0]
        mbs = [build_micro_batch(batch, ids, pad_token_id=self.pad_token_id) for ids in plan]
        lps = self._forward_log_probs(self.model, mbs)
        return per_sample_log_probs(mbs, lps, num_samples=len(batch.tokens),
                                    contribute=self.is_last and self.tp_rank == 0)

    # ----------------------------------------------------------------- training
    def _set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def _optimizer_step(self) -> float:
        ok, grad_norm, _ = self.optimizer.step()
        if not ok:
            raise RuntimeError("megatron optimizer step was skipped (inf/nan gradients)")
        return float(grad_norm) if grad_norm is not None else 0.0

    def _zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def _all_reduce_metrics(self, sums: dict[str, torch.Tensor]) -> dict[str, float]:
        """Sum over DP ranks of the last stage's metrics (TP ranks hold identical copies)."""
        keys = sorted(self.config_metric_keys)
        unknown = set(sums) - set(keys)
        if unknown:  # every rank must all-reduce the same vector: keep the list complete
            raise RuntimeError(f"metrics {sorted(unknown)} missing from config_metric_keys")
        contributes = self.is_last and self.tp_rank == 0
        flat = torch.tensor([float(sums[k]) if (contributes and k in sums) else 0.0
                             for k in keys], dtype=torch.float64)
        dist.all_reduce(flat)
        return {k: float(v) for k, v in zip(keys, flat)}

    @property
    def config_metric_keys(self) -> set[str]:
        """Every metric name the objective can emit with this config (all ranks must
        all-reduce the same vector, also stages that never compute a loss)."""
        algo = self.config.algo
        if algo.policy_loss == "sft":
            return {"train/sft_loss"}
        keys = {"train/pg_loss", "train/pg_clipfrac", "train/ppo_kl", "train/loss",
                "train/rollout_logprob_abs_diff", "train/entropy"}
        if algo.tis_clip is not None:
            keys.add("train/tis_weight")
        if self.ref is not None:
            keys.add("train/kl")
        return keys

    def train_step(self, batch: BatchLike) -> dict[str, float]:
        start = time.perf_counter()
        check_batch(batch)
        algo, train = self.config.algo, self.config.train
        if algo.policy_loss == "sft":
            return self.sft_step(batch)
        ranges = minibatch_ranges(len(batch.tokens), train.global_batch_size)
        plan = self._plan(batch, train.global_batch_size)
        mbs = [[build_micro_batch(batch, ids, pad_token_id=self.pad_token_id) for ids in step]
               for step in plan]
        flat_mbs = [mb for step in mbs for mb in step]

        ref = self._forward_log_probs(self.ref, flat_mbs) if self.ref is not None else None
        kl_in_reward = algo.advantage_estimator == "reinforce_pp" and ref is not None
        pre = (self._forward_log_probs(self.model, flat_mbs)
               if len(ranges) > 1 or kl_in_reward else None)
        old = pre if len(ranges) > 1 else None
        advantages = micro_batch_advantages(self.config.algo, batch, flat_mbs, pre, ref,
                                            self.device)

        sums: dict[str, torch.Tensor] = {}
        grad_norms, lrs = [], []
        base = 0
        for step_range, step_mbs in zip(ranges, mbs):
            norms = step_norms(batch, step_range)
            lr = lr_at(self.optimizer_steps, lr=train.lr, min_lr=train.min_lr,
                       schedule=train.lr_schedule, warmup_steps=train.warmup_steps,
                       total_steps=self.total_optimizer_steps)
            self._set_lr(lr)

            def loss_fn(j, mb, logits, row, col, base=base, norms=norms):
                k = base + j
                logp, entropy = self._token_log_probs(
                    logits, mb, row, col, with_entropy=True, entropy_grad=algo.entropy_coef > 0)
                dev = self.device
                inputs = TokenInputs(
                    loss_mask=mb.loss_mask.to(dev), seq_idx=mb.seq_idx.to(dev),
                    num_seqs=mb.num_seqs, advantages=advantages[k],
                    old_log_probs=old[k] if old is not None else None,
                    rollout_log_probs=mb.rollout_log_probs.to(dev),
                    rollout_mask=mb.rollout_mask.to(dev),
                    ref_log_probs=ref[k] if ref is not None else None)
                loss, metrics = policy_objective(algo, inputs, logp, entropy, norms)
                if mb.num_seqs == 0:  # padding micro-batch: runs for the collectives only
                    return logp.sum() * 0.0
                for name, value in metrics.items():
                    sums[name] = sums.get(name, 0.0) + value.detach()
                return loss

            self.model.train()
            self._zero_grad()
            self._run(self.model, step_mbs, loss_fn, forward_only=False)
            grad_norms.append(self._optimizer_step())
            lrs.append(lr)
            self.optimizer_steps += 1
            base += len(step_mbs)
        return train_step_metrics(self._all_reduce_metrics(sums), grad_norms=grad_norms,
                                  lrs=lrs, start=start)

    def sft_step(self, batch: BatchLike) -> dict[str, float]:
        start = time.perf_counter()
        check_batch(batch)
        plan = self._plan(batch, None)[0]
        mbs = [build_micro_batch(batch, ids, pad_token_id=self.pad_token_id) for ids in plan]
        norms = step_norms(batch, range(len(batch.tokens)))
        self._set_lr(self.config.warmup.lr)
        sums: dict[str, torch.Tensor] = {}

        def loss_fn(k, mb, logits, row, col):
            logp, _ = self._token_log_probs(logits, mb, row, col, with_entropy=False)
            loss, metrics = sft_objective(logp, mb.loss_mask.to(self.device), norms)
            if mb.num_seqs == 0:
                return logp.sum() * 0.0
            for name, value in metrics.items():
                sums[name] = sums.get(name, 0.0) + value.detach()
            return loss

        self.model.train()
        self._zero_grad()
        self._run(self.model, mbs, loss_fn, forward_only=False)
        grad_norm = self._optimizer_step()
        self.sft_steps += 1
        keys = {"train/sft_loss"}
        contributes = self.is_last and self.tp_rank == 0
        flat = torch.tensor([float(sums.get(k, 0.0)) if contributes else 0.0 for k in sorted(keys)],
                            dtype=torch.float64)
        dist.all_reduce(flat)
        out = dict(zip(sorted(keys), flat.tolist()))
        out.update({"train/grad_norm": grad_norm, "train/lr": self.config.warmup.lr,
                    "perf/train_time": time.perf_counter() - start})
        return out

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

    def named_weight_buckets(self, bucket_bytes: int) -> Iterator[NamedTensors]:
        """Full HF-named tensors (TP shards gathered, PP stages broadcast) in ~bucket_bytes
        buckets, on every rank. Collective: every rank must drain the iterator."""
        from trainer.backends.megatron import model as M

        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be > 0 (got {bucket_bytes})")
        params = dict(self.gpt.named_parameters())
        offset = M.layer_offset(self.gpt)
        local = {hf_map.global_name(n, offset): p for n, p in params.items()}
        tied = bool(self.hf.tie_word_embeddings)
        pp_group = self.ps.get_pipeline_model_parallel_group()
        bucket: NamedTensors = []
        size = 0
        for stage, name in self._hf_layout:
            if stage == self.pp_rank:
                full = M.gather_tp(name, local[name].detach())
                pairs = hf_map.to_hf(self.hf, name, full, te_names=self.use_te, tied=tied)
                pairs = [(n, t.to("cpu", copy=True).contiguous()) for n, t in pairs]
            else:
                pairs = None
            if self.pp_size > 1:
                obj = [pairs]
                dist.broadcast_object_list(obj, src=dist.get_global_rank(pp_group, stage),
                                           group=pp_group)
                pairs = obj[0]
            for hf_name, tensor in pairs:
                nbytes = tensor.numel() * tensor.element_size()
                if bucket and size + nbytes > bucket_bytes:
                    yield bucket
                    bucket, size = [], 0
                bucket.append((hf_name, tensor))
                size += nbytes
        if bucket:
            yield bucket

    # ----------------------------------------------------------------- checkpoints
    def _optimizers(self) -> list:
        return list(getattr(self.optimizer, "chained_optimizers", None) or [self.optimizer])

    def save(self, path: str) -> None:
        """Per-rank files: model shard, this rank's optimizer shard, counters and RNG.
        Reloading needs the same (TP, PP, DP) layout; HF export is the portable format."""
        os.makedirs(path, exist_ok=True)
        state = {"model": self.gpt.state_dict(), "optimizer_steps": self.optimizer_steps,
                 "sft_steps": self.sft_steps, "cpu_rng": torch.get_rng_state(),
                 "layout": (self.tp_size, self.pp_size, self.dp_size)}
        # Per rank, the inner torch optimizer over this rank's main-parameter shards: its
        # state_dict (Adam moments, steps) plus the main parameters themselves (fp32
        # copies under bf16; views of the model's buffer under fp32). megatron-core's own
        # dp-reshardable save/load pair does not round-trip in 0.16.1 without apex/TE.
        opts = []
        for opt in self._optimizers():
            inner = opt.optimizer
            mains = [p.detach().clone() for g in inner.param_groups for p in g["params"]]
            opts.append({"inner": inner.state_dict(), "main_params": mains})
        state["optimizers"] = opts
        torch.save(state, os.path.join(path, f"megatron_rank{self.rank}.pt"))
        dist.barrier()

    def load(self, path: str) -> None:
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
            inner.load_state_dict(entry["inner"])
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
    def offload(self) -> None:
        """GPU: move the Adam moments to host memory. Model weights, fp32 main params and
        DDP grad buffers stay on the GPU: Megatron's parameters (and fp32 main params) are
        views into contiguous buffers that ``module.to()`` would silently detach; freeing
        them needs torch_memory_saver-style buffer release (not done yet). CPU: no-op."""
        if self.cpu:
            return
        self._move_optimizer("cpu")
        torch.cuda.empty_cache()

    def onload(self) -> None:
        if self.cpu:
            return
        self._move_optimizer(self.device)

    def _move_optimizer(self, device) -> None:
        for opt in self._optimizers():
            inner = getattr(opt, "optimizer", None)
            if inner is None:
                continue
            for st in inner.state.values():
                for key, value in st.items():
                    if isinstance(value, torch.Tensor) and value.dim() > 0:
                        st[key] = value.to(device, non_blocking=True)
        torch.cuda.synchronize()
