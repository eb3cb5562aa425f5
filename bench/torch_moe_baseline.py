#!/usr/bin/env python3
"""Naive PyTorch MoE layer, forward + backward: the baseline of bench_moe_layer.

This is the brute-force layer FastMoE compares against: a linear gate with softmax and top-k,
then a Python loop over experts, each with its own weight tensors, gathering its tokens with
index_select and scattering its weighted output back with index_add, plus (--shared) one FFN
that every token goes through. Autograd does backward.
Prints one JSON object: {"ms": median milliseconds per iteration, "peak_rss_mb": ..., "threads": ...}.

--device cuda (bench_moe_gpu's baseline) runs the same layer on the GPU, timing each iteration
between torch.cuda.synchronize() calls, and adds "device", "gpu" and "peak_cuda_mb" (the most GPU
memory torch held, MiB). --bf16 runs the forward under torch.autocast to bfloat16 (the GEMMs take
bfloat16 inputs). When the layer cannot run (torch missing, no CUDA), the object is {"error": ...}.

--grouped (with --device cuda --bf16) is PyTorch's own MoE path instead of the loop, the grouped
GEMM its MoE training uses (torchtitan's): the experts' weights are stacked fp32 parameters
[E, out, in], cast to bfloat16 every step; the routed rows are sorted by expert into one bf16
matrix, each expert's rows padded with zeros to a multiple of 8 (torchtitan's token-group
alignment for bf16); torch._grouped_mm multiplies every expert's rows by its matrix in one call,
for each of the two matrices, with each expert's bias added per row; autograd does backward.

"""
import argparse
import contextlib
import json
import resource
import statistics
import sys
import time


def main():
    ap = argparse.ArgumentParser()
    for name in ("tokens", "d_model", "d_hidden", "experts", "k"):
        ap.add_argument("--" + name, type=int, required=True)
    ap.add_argument("--shared", type=int, default=0,
                    help="shared experts of d_hidden each: one FFN of shared * d_hidden that every "
                         "token goes through, added with weight 1")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--bf16", action="store_true",
                    help="forward under torch.autocast(dtype=torch.bfloat16)")
    ap.add_argument("--grouped", action="store_true",
                    help="the experts through torch._grouped_mm (needs --device cuda --bf16)")
    args = ap.parse_args()
    try:
        import torch
    except ImportError:
        print(json.dumps({"error": "python3-torch is not installed "
                                   "(scripts/install-deps.sh --with-torch installs it)"}), flush=True)
        return 0
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        why = ("torch %s was built without CUDA" % torch.__version__
               if torch.version.cuda is None else "torch sees no CUDA device")
        print(json.dumps({"error": why}), flush=True)
        return 0
    if args.grouped:
        if not (cuda and args.bf16):
            print(json.dumps({"error": "--grouped needs --device cuda --bf16"}), flush=True)
            return 0
        if not hasattr(torch, "_grouped_mm"):
            print(json.dumps({"error": "torch %s has no torch._grouped_mm (PyTorch >= 2.8)"
                                       % torch.__version__}), flush=True)
            return 0
    dev = torch.device(args.device)
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    T, C, H, E, k = args.tokens, args.d_model, args.d_hidden, args.experts, args.k
    gate = torch.nn.Linear(C, E, bias=False)
    w1 = [torch.nn.Linear(C, H) for _ in range(E)]
    w2 = [torch.nn.Linear(H, C) for _ in range(E)]
    shared = (torch.nn.Sequential(torch.nn.Linear(C, args.shared * H),
                                  torch.nn.GELU(approximate="tanh"),
                                  torch.nn.Linear(args.shared * H, C))
              if args.shared > 0 else None)
    x = torch.randn(T, C, requires_grad=True)
    dy = torch.randn(T, C)
    if cuda:
        gate = gate.to(dev)
        w1 = [m.to(dev) for m in w1]
        w2 = [m.to(dev) for m in w2]
        if shared is not None:
            shared = shared.to(dev)
        x = x.detach().to(dev).requires_grad_(True)
        dy = dy.to(dev)

    def autocast():
        if not args.bf16:
            return contextlib.nullcontext()
        return torch.autocast(device_type=args.device, dtype=torch.bfloat16)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def forward():
        probs = torch.softmax(gate(x), dim=-1)
        weights, experts = torch.topk(probs, k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        flat_x = x.repeat_interleave(k, dim=0)
        flat_e = experts.reshape(-1)
        flat_w = weights.reshape(-1, 1)
        token_of = torch.arange(T, device=dev).repeat_interleave(k)
        for e in range(E):
            rows = (flat_e == e).nonzero(as_tuple=True)[0]
            if rows.numel() == 0:
                continue
            xe = flat_x.index_select(0, rows)
            ye = w2[e](torch.nn.functional.gelu(w1[e](xe), approximate="tanh"))
            out = out.index_add(0, token_of.index_select(0, rows),
                                (ye * flat_w.index_select(0, rows)).to(out.dtype))
        if shared is not None:
            out = out + shared(x).to(out.dtype)
        return out

    if args.grouped:
        # Stacked expert parameters [E, out, in] (fp32 master weights), as torch.nn.Linear lays
        # out each expert's, and their biases.
        W1 = torch.nn.Parameter(torch.stack([m.weight.detach() for m in w1]))
        B1 = torch.nn.Parameter(torch.stack([m.bias.detach() for m in w1]))
        W2 = torch.nn.Parameter(torch.stack([m.weight.detach() for m in w2]))
        B2 = torch.nn.Parameter(torch.stack([m.bias.detach() for m in w2]))
        w1 = w2 = None  # the stacked copies are the experts now: free the per-expert layers
        align = 8

        def grouped_forward():
            probs = torch.softmax(gate(x), dim=-1)
            weights, experts = torch.topk(probs, k, dim=-1)
            weights = weights / weights.sum(dim=-1, keepdim=True)
            flat_e = experts.reshape(-1)
            order = torch.argsort(flat_e, stable=True)
            sorted_e = flat_e.index_select(0, order)
            counts = torch.bincount(flat_e, minlength=E)
            padded = (counts + align - 1) // align * align
            ends = torch.cumsum(padded, 0)
            starts = ends - padded
            first = torch.cumsum(counts, 0) - counts
            rank = torch.arange(T * k, device=dev) - first.index_select(0, sorted_e)
            dest = starts.index_select(0, sorted_e) + rank
            total = int(ends[-1])
            token = order // k
            xs = x.index_select(0, token).to(torch.bfloat16)
            xp = torch.zeros(total, C, device=dev, dtype=torch.bfloat16).index_copy(0, dest, xs)
            offs = ends.to(torch.int32)
            row_expert = torch.repeat_interleave(torch.arange(E, device=dev), padded,
                                                 output_size=total)
            h = torch._grouped_mm(xp, W1.to(torch.bfloat16).transpose(-2, -1), offs=offs)
            h = h + B1.to(torch.bfloat16).index_select(0, row_expert)
            a = torch.nn.functional.gelu(h, approximate="tanh")
            yp = torch._grouped_mm(a, W2.to(torch.bfloat16).transpose(-2, -1), offs=offs)
            yp = yp + B2.to(torch.bfloat16).index_select(0, row_expert)
            y = yp.index_select(0, dest).float() * weights.reshape(-1).index_select(0, order)[:, None]
            out = torch.zeros(T, C, device=dev).index_add(0, token, y)
            if shared is not None:
                out = out + shared(x).to(out.dtype)
            return out

    def step():
        if args.grouped:
            with autocast():
                out = grouped_forward()
        else:
            with autocast():
                out = forward()
        out.backward(dy)

    for _ in range(args.warmup):
        step()
    sync()

    times = []
    for _ in range(args.iters):
        sync()
        start = time.perf_counter()
        step()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    ms = statistics.median(times)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    result = {"ms": ms, "peak_rss_mb": peak_mb, "threads": torch.get_num_threads(),
              "torch": torch.__version__}
    if cuda:
        result.update({"device": "cuda", "gpu": torch.cuda.get_device_name(),
                       "peak_cuda_mb": torch.cuda.max_memory_allocated() / 2**20})
    if args.bf16:
        result["bf16"] = True
    if args.grouped:
        result["grouped"] = True
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
