#!/usr/bin/env python3
"""Does the MoE learn more per FLOP? Three models of equal active compute per token, trained alike.

On the default corpus (examples/moe_lm: bytes of fortunes) and the example's Transformer (d_model
128, 4 blocks, 64-byte windows, batch 32), three FFNs with the same active hidden width per token:

  dense        a dense FFN of width 256 in every block;
  top2_of_16   16 experts of width 128, top-2 (softmax, aux loss) -- examples/moe_lm's model;
  top8_of_64   64 fine-grained experts of width 28, top-8, plus 1 shared expert of width 28
               (9 x 28 = 252 wide per token), DeepSeek-V3's router: sigmoid scores, loss-free
               balancing (bias rate 0.001), routed scaling 2.5, no aux loss.

Each trains for the same number of steps, one after another (so they never share the cores), with
held-out bits per byte every --eval-every steps. The script draws held-out bits per byte against
steps and against training seconds (the sum of the steps' step_ms: evaluation excluded) into a PNG,
and prints a table of final figures in Markdown. Needs python3-matplotlib
(scripts/install-deps.sh --with-plots).

  python3 bench/compare_moe.py --strata build/bin/strata --out docs/images/compare_moe.png
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

MODEL = """
name: "{name}"
seed: 1234
model {{
  vocab_size: 256
  seq_len: 64
  d_model: 128
  n_layers: 4
  n_heads: 4
  activation: GELU
  {ffn}
}}
data {{ path: "{data}" format: BYTES eval_fraction: 0.05 }}
train {{
  steps: {steps} global_batch: 32 lr: 0.006 warmup_steps: 100 schedule: COSINE min_lr_ratio: 0.1
  weight_decay: 0.1 grad_clip: 1.0 eval_every: {eval_every} eval_batches: 16 threads: {threads}
}}
"""

VARIANTS = [
    ("dense", "dense FFN 256", "moe_every: 0 d_ff: 256"),
    ("top2_of_16", "top-2 of 16 x 128",
     "moe_every: 1 moe { num_experts: 16 top_k: 2 d_expert: 128 "
     "gate { type: TOP_K capacity_factor_train: 0 aux_loss_coef: 0.01 z_loss_coef: 0.001 } }"),
    ("top8_of_64_shared", "top-8 of 64 x 28 + 1 shared",
     "moe_every: 1 moe { num_experts: 64 top_k: 8 d_expert: 28 num_shared_experts: 1 "
     "gate { type: TOP_K capacity_factor_train: 0 score_function: SIGMOID bias_update_rate: 0.001 "
     "routed_scaling: 2.5 aux_loss_coef: 0 z_loss_coef: 0.001 } }"),
]


def train(strata, workdir, name, ffn, args):
    cfg = os.path.join(workdir, name + ".textproto")
    metrics = os.path.join(workdir, name + ".jsonl")
    with open(cfg, "w") as f:
        f.write(MODEL.format(name=name, ffn=ffn, data=os.path.abspath(args.data), steps=args.steps,
                             eval_every=args.eval_every, threads=args.threads))
    started = time.time()
    print("training %s ..." % name, file=sys.stderr, flush=True)
    run = subprocess.run([strata, "train", "--config", cfg, "--metrics-out", metrics, "--quiet"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if run.returncode != 0:
        sys.exit("compare_moe: %s failed (exit %d):\n%s" % (name, run.returncode, run.stdout))
    params, blas = "", []
    for line in run.stdout.splitlines():
        if " parameters (" in line:
            params = line.split("] ", 1)[-1]
        if "] blas: " in line:  # the kernel the run's GEMMs ran on, and a warning if below the best
            blas.append(line.split("] ", 1)[-1])
    steps, seconds, bpb, tok_s, balance = [], [], [], [], []
    elapsed = 0.0
    with open(metrics) as f:
        for line in f:
            m = json.loads(line)
            elapsed += m["step_ms"] / 1e3
            tok_s.append(m["tokens_per_s"])
            if "eval_bits_per_byte" in m:
                steps.append(m["step"])
                seconds.append(elapsed)
                bpb.append(m["eval_bits_per_byte"])
            if m.get("moe"):
                balance = [layer["max_over_mean"] for layer in m["moe"]]
    tok_s.sort()
    return {"name": name, "steps": steps, "seconds": seconds, "bpb": bpb, "train_s": elapsed,
            "wall_s": time.time() - started, "tok_s": tok_s[len(tok_s) // 2], "params": params,
            "blas": blas,
            "balance": balance}


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--strata", default=os.path.join(root, "build", "bin", "strata"))
    ap.add_argument("--data", default=os.path.join(root, "examples", "moe_lm", "data",
                                                   "fortunes.txt"))
    ap.add_argument("--steps", type=int, default=1800)
    ap.add_argument("--eval-every", type=int, default=150)
    ap.add_argument("--threads", type=int, default=0, help="0: all cores")
    ap.add_argument("--out", default=os.path.join(root, "docs", "images", "compare_moe.png"))
    ap.add_argument("--workdir", default="", help="keep configs and metrics here")
    args = ap.parse_args()
    if not os.path.exists(args.data):
        sys.exit("compare_moe: no corpus at %s; make it with python3 "
                 "examples/moe_lm/prepare_data.py --out %s" % (args.data, args.data))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        # Debian's package is for Debian's python3; another python3 first on PATH lacks it.
        if os.path.exists("/usr/bin/python3") and os.path.realpath(sys.executable) != \
                os.path.realpath("/usr/bin/python3"):
            os.execv("/usr/bin/python3", ["/usr/bin/python3"] + sys.argv)
        sys.exit("compare_moe: python3-matplotlib is not installed "
                 "(scripts/install-deps.sh --with-plots installs it)")
    workdir = args.workdir or tempfile.mkdtemp(prefix="strata-compare-")
    os.makedirs(workdir, exist_ok=True)
    runs = [dict(train(args.strata, workdir, name, ffn, args), label=label)
            for name, label, ffn in VARIANTS]

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for r in runs:
        by_step.plot(r["steps"], r["bpb"], marker="o", markersize=3, label=r["label"])
        by_time.plot(r["seconds"], r["bpb"], marker="o", markersize=3, label=r["label"])
    by_step.set_xlabel("step (batch 32 x 64 bytes)")
    by_time.set_xlabel("training seconds (2-core CPU, evaluation excluded)")
    by_step.set_ylabel("held-out bits per byte")
    for ax in (by_step, by_time):
        ax.grid(alpha=0.3)
    by_step.legend()
    fig.suptitle("Equal active FFN width per token (256): dense vs MoE vs fine-grained MoE")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    fig.savefig(args.out, dpi=110)

    print("| model | final held-out bpb | best | train s | tok/s (median) | max/mean load "
          "(last step, per layer) |")
    print("|---|---:|---:|---:|---:|---|")
    for r in runs:
        balance = ", ".join("%.2f" % b for b in r["balance"]) or "-"
        print("| %s | %.4f | %.4f | %.0f | %.0f | %s |" % (r["label"], r["bpb"][-1], min(r["bpb"]),
                                                           r["train_s"], r["tok_s"], balance))
    for r in runs:
        print("# %s: %s" % (r["label"], r["params"]))
    for line in runs[0]["blas"]:
        print("# %s" % line)
    print("# metrics and configs in %s; plot in %s" % (workdir, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
