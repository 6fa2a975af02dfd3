"""Fine-tune a tiny random Qwen2-VL with and without posenc_torch.hf.patch().

A few AdamW steps on synthetic image + text batches, four ways: transformers' own rotary
functions and the posenc kernels, each eagerly and with torch.compile (every decoder
layer compiled: regional compilation, as transformers recommends for training).  Every run
starts from the same weights and sees the same batches, so the losses must agree; the
script checks that, prints the loss and time of every step, and exits non-zero if the
patched losses differ.

    python examples/finetune_qwen2_vl.py            # about a minute on a small CPU
    python examples/finetune_qwen2_vl.py --quick    # a few seconds: 2 steps, no compile

Data parallel, on 2 processes (gloo on the CPU, NCCL on GPUs), with DistributedDataParallel
or FSDP2 (``torch.distributed.fsdp.fully_shard`` on every decoder layer and the model):

    torchrun --nproc-per-node 2 examples/finetune_qwen2_vl.py --distributed ddp
    torchrun --nproc-per-node 2 examples/finetune_qwen2_vl.py --distributed fsdp2

Each rank trains on its own batches; the printed losses are the mean over the ranks.

Packed (padding-free) batches: ``--packed`` lays each step's examples, of different
lengths, end to end in one row with ``posenc_torch.packing.pack_multimodal_examples`` (the
function behind ``MultimodalPackingCollator``), with per-example 3-D position ids and no
padding; it combines with ``--distributed``:

    python examples/finetune_qwen2_vl.py --quick --packed
    torchrun --nproc-per-node 2 examples/finetune_qwen2_vl.py --quick --packed --distributed fsdp2

Nothing is downloaded: the model is built from a small config with random weights.  Works
with transformers 4.57 and 5.x.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import transformers
from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

import posenc_torch
import posenc_torch.hf
from posenc_torch.packing import pack_multimodal_examples

IMAGE, VIDEO, VISION_START, VISION_END = 1020, 1021, 1022, 1023
TRANSFORMERS_MAJOR = int(transformers.__version__.split(".")[0])


def tiny_qwen2_vl(quick: bool) -> Qwen2VLForConditionalGeneration:
    """A small random Qwen2-VL: head_dim 32, M-RoPE sections [4, 6, 6] (2 * 16 = 32)."""
    text = dict(vocab_size=1024, hidden_size=256, intermediate_size=512,
                num_hidden_layers=2 if quick else 4, num_attention_heads=8, num_key_value_heads=2,
                max_position_embeddings=4096, bos_token_id=0, eos_token_id=1, pad_token_id=2,
                rope_scaling={"type": "mrope", "mrope_section": [4, 6, 6]})
    vision = dict(depth=2, embed_dim=128, num_heads=4, hidden_size=256, mlp_ratio=2,
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    config = Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE,
                           video_token_id=VIDEO, vision_start_token_id=VISION_START,
                           vision_end_token_id=VISION_END)
    return Qwen2VLForConditionalGeneration(config)


def synthetic_batch(model, batch: int, text_len: int, grid: tuple[int, int, int],
                    gen: torch.Generator) -> dict[str, torch.Tensor]:
    """``batch`` rows of ``[text, <vision_start>, image tokens, <vision_end>, text]``."""
    vc = model.config.vision_config
    t, h, w = grid
    patches = t * h * w
    image_tokens = patches // vc.spatial_merge_size ** 2
    patch_dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
    rows = []
    for _ in range(batch):
        before = torch.randint(3, 1000, (text_len // 4,), generator=gen)
        after = torch.randint(3, 1000, (text_len - text_len // 4,), generator=gen)
        rows.append(torch.cat([before, torch.tensor([VISION_START]),
                               torch.full((image_tokens,), IMAGE), torch.tensor([VISION_END]),
                               after]))
    input_ids = torch.stack(rows)
    labels = input_ids.masked_fill(input_ids >= IMAGE, -100)  # no loss on vision tokens
    out = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), labels=labels,
               pixel_values=torch.randn(batch * patches, patch_dim, generator=gen),
               image_grid_thw=torch.tensor([grid] * batch))
    if TRANSFORMERS_MAJOR >= 5:  # 5.x builds the 3-D positions from the token types
        out["mm_token_type_ids"] = (input_ids == IMAGE).int()
    return out


def synthetic_packed_batch(model, batch: int, text_len: int, grid: tuple[int, int, int],
                           gen: torch.Generator) -> dict[str, object]:
    """``batch`` examples of ``[text, <vision_start>, image tokens, <vision_end>, text]`` with
    text of ``text_len / 2`` to ``text_len`` tokens, each as a processor returns it, packed
    into one row (no padding)."""
    vc = model.config.vision_config
    t, h, w = grid
    patches = t * h * w
    patch_dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
    examples = []
    for _ in range(batch):
        n = int(torch.randint(text_len // 2, text_len + 1, (1,), generator=gen))
        ids = torch.cat([torch.randint(3, 1000, (n // 4,), generator=gen),
                         torch.tensor([VISION_START]),
                         torch.full((patches // vc.spatial_merge_size ** 2,), IMAGE),
                         torch.tensor([VISION_END]),
                         torch.randint(3, 1000, (n - n // 4,), generator=gen)])[None]
        example = dict(input_ids=ids, attention_mask=torch.ones_like(ids),
                       labels=ids.masked_fill(ids >= IMAGE, -100),
                       pixel_values=torch.randn(patches, patch_dim, generator=gen),
                       image_grid_thw=torch.tensor([grid]))
        if TRANSFORMERS_MAJOR >= 5:
            example["mm_token_type_ids"] = (ids == IMAGE).int()
        examples.append(example)
    return pack_multimodal_examples(examples, model)


def compile_regions(model) -> None:
    """Compile every decoder layer (regional compilation: the layers share one graph)."""
    for layer in model.model.language_model.layers:
        layer.compile()


def setup_distributed() -> torch.device:
    """Join the process group torchrun describes (NCCL with one GPU per rank where there
    are GPUs, else gloo on the CPU); returns this rank's device."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        return device
    dist.init_process_group("gloo")
    return torch.device("cpu")


def data_parallel(model, mode: str, device: torch.device):
    """``model`` trained data-parallel: DDP (gradients all-reduced) or FSDP2 (parameters,
    gradients and optimizer state sharded over the ranks, each decoder layer gathered
    when it runs)."""
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[device.index] if device.index is not None
                                       else None)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in model.model.language_model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


class Run:
    """One model with its optimizer; ``step`` trains on one batch and records loss and time."""

    def __init__(self, initial, compiled: bool, lr: float, parallel: str | None = None,
                 device: torch.device | None = None) -> None:
        device = device or torch.device("cpu")
        self.model = copy.deepcopy(initial).to(device).train()
        if parallel is not None:
            self.model = data_parallel(self.model, parallel, device)
        if compiled:
            compile_regions(self.model)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.losses: list[float] = []
        self.seconds: list[float] = []

    def step(self, batch) -> None:
        start = time.perf_counter()
        loss = self.model(**batch).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.seconds.append(time.perf_counter() - start)
        self.losses.append(loss.item())


def train_both(initial, batches, *, compiled: bool, lr: float = 1e-3,
               parallel: str | None = None, device: torch.device | None = None):
    """Train two copies of ``initial`` on the same batches, one with transformers' rotary
    functions and one with posenc's.

    In your own training you call ``posenc_torch.hf.patch()`` once, before building and
    compiling the model.  Here, for a fair timing on a machine shared with other work, the
    two runs take turns step by step, and the patch is switched on only around the posenc
    run's steps.  (Under torch.compile that costs one extra compilation per compiled region:
    dynamo guards on the rotary function it traced, so each run gets its own graph.)
    """
    torch._dynamo.reset()
    plain = Run(initial, compiled, lr, parallel, device)
    patched = Run(initial, compiled, lr, parallel, device)
    calls: dict[str, int] = {}
    fallbacks = 0
    for i, batch in enumerate(batches):
        for run in (plain, patched) if i % 2 == 0 else (patched, plain):
            if run is plain:
                run.step(batch)
                continue
            with posenc_torch.hf.patch("qwen2_vl") as handle:
                run.step(batch)
            for target, n in handle.calls.items():
                calls[target] = calls.get(target, 0) + n
            fallbacks += sum(handle.fallbacks.values())
    return plain, patched, calls, fallbacks


def rotary_alone(initial, batch, repeats: int) -> None:
    """Time each rotary call of one forward pass on its own, forward + backward, with the
    arguments the model passes (shapes, strides, dtypes): transformers' function against
    the posenc replacement.  This is the part of a step the patch changes."""
    import importlib

    module = importlib.import_module(type(initial).__module__)
    seen: dict[str, tuple] = {}
    with posenc_torch.hf.patch("qwen2_vl") as handle:
        names = [target.split(".", 1)[1] for target in handle.targets
                 if "rotary" in target]  # not get_rope_index, not the vision_utils routes
        replacements = {name: getattr(module, name) for name in names}

        def recorder(name):
            def record(*args, **kwargs):
                seen.setdefault(name, (args, kwargs, 0))
                a, kw, n = seen[name]
                seen[name] = (a, kw, n + 1)
                return replacements[name](*args, **kwargs)
            return record

        for name in names:
            setattr(module, name, recorder(name))
        try:
            with torch.no_grad():
                initial(**batch)
        finally:
            for name in names:
                setattr(module, name, replacements[name])

        print("\n[rotary alone]  forward + backward of one call, fastest of "
              f"{repeats} (calls per step)")
        for name, (args, kwargs, per_step) in seen.items():
            q, k = (t.detach().clone().requires_grad_() for t in args[:2])
            rest = args[2:]
            times = {}
            for label, fn in (("transformers", posenc_torch.hf.original_of(replacements[name])),
                              ("posenc", replacements[name])):
                best = float("inf")
                for _ in range(repeats):
                    start = time.perf_counter()
                    q_out, k_out = fn(q, k, *rest, **kwargs)
                    torch.autograd.backward([q_out, k_out], [q_out.detach(), k_out.detach()])
                    best = min(best, time.perf_counter() - start)
                    q.grad = k.grad = None
                times[label] = best
            ref_us, pe_us = 1e6 * times["transformers"], 1e6 * times["posenc"]
            print(f"  {name} q {tuple(q.shape)} x {per_step}: transformers {ref_us:.0f} us, "
                  f"posenc {pe_us:.0f} us (speed-up {ref_us / pe_us:.2f}x); per step "
                  f"{per_step * ref_us / 1e3:.2f} ms vs {per_step * pe_us / 1e3:.2f} ms")


def mean_over_ranks(values: list[float]) -> list[float]:
    if not dist.is_initialized():
        return values
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)  # gloo and NCCL both sum float64
    return (t / dist.get_world_size()).tolist()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="2 steps on a 2-layer model, eager only (for tests)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps (default 6)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile runs")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--text-len", type=int, default=192, help="text tokens per row")
    parser.add_argument("--rtol", type=float, default=1e-4,
                        help="relative tolerance of the loss comparison")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch (and posenc) threads; 1 gives steadier timings on a busy "
                             "machine, where waking a second thread can wait for a time slice")
    parser.add_argument("--distributed", choices=["ddp", "fsdp2"], default=None,
                        help="data-parallel training under torchrun (eager only)")
    parser.add_argument("--packed", action="store_true",
                        help="examples of different lengths packed into one row per step "
                             "(posenc_torch.packing) instead of a batch of equal rows")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    steps = args.steps if args.steps is not None else (2 if args.quick else 6)
    eager_only = args.quick or args.no_compile or args.distributed
    compiled_modes = [False] if eager_only else [False, True]
    device, rank = torch.device("cpu"), 0
    if args.distributed:
        device, rank = setup_distributed(), dist.get_rank()
    say = print if rank == 0 else (lambda *a, **kw: None)
    batch, text_len = (2, 32) if args.quick else (args.batch, args.text_len)
    grid = (1, 8, 8) if args.quick else (1, 16, 16)  # patch grid: 16 or 64 image tokens

    torch.manual_seed(0)
    initial = tiny_qwen2_vl(args.quick)
    gen = torch.Generator().manual_seed(1 + rank)  # each rank its own data
    make = synthetic_packed_batch if args.packed else synthetic_batch
    batches = [{key: value.to(device) if isinstance(value, torch.Tensor) else value
                for key, value in make(initial, batch, text_len, grid, gen).items()}
               for _ in range(steps)]
    seq = batches[0]["input_ids"].shape[1]
    text_cfg = initial.config.text_config
    say(f"transformers {transformers.__version__}, torch {torch.__version__}, posenc kernel "
        f"{posenc_torch.kernel_isa()}, {torch.get_num_threads()} threads")
    if args.distributed:
        say(f"{args.distributed.upper()} on {dist.get_world_size()} ranks "
            f"({dist.get_backend()}, {device.type}); per-rank batches, mean loss over ranks")
    shape = (f"{batch} examples packed into 1 row of {seq} tokens" if args.packed
             else f"batch {batch} x {seq} tokens")
    say(f"tiny Qwen2-VL: {text_cfg.num_hidden_layers} decoder layers, "
          f"{sum(p.numel() for p in initial.parameters()) / 1e6:.1f}M parameters; "
          f"{shape} (image grid {grid}), {steps} steps")

    ok = True
    for compiled in compiled_modes:
        mode = "torch.compile" if compiled else "eager"
        plain, patched, calls, fallbacks = train_both(initial, batches, compiled=compiled,
                                                      parallel=args.distributed, device=device)
        ref_losses, ref_s = mean_over_ranks(plain.losses), plain.seconds
        pe_losses, pe_s = mean_over_ranks(patched.losses), patched.seconds
        say(f"\n[{mode}]  step   loss (transformers)   loss (posenc)   "
              "ms/step (transformers)   ms/step (posenc)")
        for i in range(steps):
            say(f"{'':{len(mode) + 3}} {i:4d}   {ref_losses[i]:19.6f}   {pe_losses[i]:13.6f}"
                  f"   {1e3 * ref_s[i]:22.1f}   {1e3 * pe_s[i]:16.1f}")
        # The first step includes compilation (and warm-up), so time the others.  Other
        # processes can only add time, so the fastest step is the steadiest figure.
        timed = slice(1, None) if steps > 1 else slice(None)
        for name, stat in (("fastest", min), ("median", statistics.median)):
            ref_ms, pe_ms = 1e3 * stat(ref_s[timed]), 1e3 * stat(pe_s[timed])
            say(f"{'':{len(mode) + 3}} {name} ms/step after step 0: transformers "
                  f"{ref_ms:.1f}, posenc {pe_ms:.1f} (speed-up {ref_ms / pe_ms:.2f}x)")
        say(f"{'':{len(mode) + 3}} posenc calls: {calls}, fallbacks: {fallbacks}")
        worst = max(abs(a - b) / abs(a) for a, b in zip(ref_losses, pe_losses, strict=True))
        # A packed batch brings its position ids (from posenc_torch.packing), so the model
        # never calls get_rope_index; every other patched function must have run.
        # (and carries the vision tower's kwargs, precomputed by posenc: the routed
        # vision_utils functions then only hand them over)
        expected = [t for t in calls if not (args.packed and (
            t.endswith(".get_rope_index") or ".get_vision_" in t))]
        ran = all(calls[t] > 0 for t in expected) and fallbacks == 0
        same = worst <= args.rtol
        say(f"{'':{len(mode) + 3}} {'OK' if same and ran else 'MISMATCH'}: losses "
              f"{'match' if same else 'differ'} (largest relative difference {worst:.2e}, "
              f"tolerance {args.rtol:.0e}); posenc kernels {'ran' if ran else 'did NOT run'}")
        ok &= same and ran
    if args.distributed:
        dist.barrier()  # every rank is done with the process group (see the end of the file)
    else:
        rotary_alone(initial, batches[0], repeats=5 if args.quick else 50)
    say("\nall losses match" if ok else "\nFAILED: patched and unpatched runs differ")
    return 0 if ok else 1


if __name__ == "__main__":
    status = main()
    if dist.is_available() and dist.is_initialized():
        # Under torchrun with gloo on the CPU, tearing the process group down (or the
        # interpreter's shutdown) sometimes never finished on one rank (torch 2.13, a
        # native thread still running).  Every rank has passed the barrier and reported, so
        # leave without the teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)
