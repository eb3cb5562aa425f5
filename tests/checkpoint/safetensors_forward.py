#!/usr/bin/env python3
"""An independent reader of `strata ckpt export`: parses the safetensors file with the standard
library, checks its layout, and recomputes the model's forward pass in numpy (float64) from the
JSON config beside it. No strata code.

    safetensors_forward.py MODEL.safetensors CONFIG.json TOKENS.i32 B OUT.f32

TOKENS.i32 holds B sequences of seq_len little-endian int32 tokens; OUT.f32 gets the logits
[B * seq_len, vocab_size] as little-endian float32. Exits 1 with a message on a malformed file.
"""
import json
import struct
import sys

import numpy as np


def fail(why):
    print("safetensors_forward.py: " + why, file=sys.stderr)
    sys.exit(1)


def read_safetensors(path):
    with open(path, "rb") as f:
        blob = f.read()
    if len(blob) < 8:
        fail("%s is shorter than its 8-byte header size" % path)
    (n,) = struct.unpack("<Q", blob[:8])
    if 8 + n > len(blob) or n % 8 != 0:
        fail("header size %d does not fit the file or is not a multiple of 8" % n)
    header = json.loads(blob[8:8 + n].decode("utf-8"))
    data = blob[8 + n:]
    header.pop("__metadata__", None)
    spans = []
    tensors = {}
    for name, t in header.items():
        if t["dtype"] != "F32":
            fail("%s has dtype %s, not F32" % (name, t["dtype"]))
        begin, end = t["data_offsets"]
        count = int(np.prod(t["shape"])) if t["shape"] else 1
        if end - begin != 4 * count:
            fail("%s: %d bytes for shape %s" % (name, end - begin, t["shape"]))
        spans.append((begin, end))
        tensors[name] = np.frombuffer(data[begin:end], dtype="<f4").reshape(t["shape"]).astype(np.float64)
    # The data is indexed entirely, without holes or overlaps.
    at = 0
    for begin, end in sorted(spans):
        if begin != at:
            fail("the data has a hole or an overlap at byte %d" % at)
        at = end
    if at != len(data):
        fail("the tensors cover %d of the data's %d bytes" % (at, len(data)))
    return tensors


def norm(x, w, b, cfg):
    eps = cfg["norm_eps"]
    if cfg["norm"] == "rms_norm":
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * w + b


def ffn(x, p, prefix, cfg, bias):
    up = p[prefix + ("gate_up_proj" if cfg["activation"] == "swiglu" else "up_proj") + ".weight"]
    h = x @ up.T
    if bias:
        h = h + p[prefix + ("gate_up_proj" if cfg["activation"] == "swiglu" else "up_proj") + ".bias"]
    act = cfg["activation"]
    if act == "gelu_tanh":
        h = 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h ** 3)))
    elif act == "relu":
        h = np.maximum(h, 0)
    elif act == "swiglu":
        g, u = np.split(h, 2, axis=-1)
        h = g / (1 + np.exp(-g)) * u
    else:
        fail("unknown activation " + act)
    y = h @ p[prefix + "down_proj.weight"].T
    if bias:
        y = y + p[prefix + "down_proj.bias"]
    return y


def route(logits, bias, r):
    """The k experts of one token and their weights, as the config's router describes."""
    if r["score"] == "sigmoid":
        scores = 1 / (1 + np.exp(-logits))
    else:
        e = np.exp(logits - logits.max())
        scores = e / e.sum()
    sel = scores + bias if bias is not None else scores.copy()
    k = r["k"]
    groups = r["num_groups"]
    if groups > 1:
        per = len(sel) // groups
        top = max(1, k // r["topk_groups"])
        gscore = [np.sort(sel[g * per:(g + 1) * per])[::-1][:top].sum() for g in range(groups)]
        keep = sorted(range(groups), key=lambda g: (-gscore[g], g))[:r["topk_groups"]]
        mask = np.full(len(sel), -np.inf)
        for g in keep:
            mask[g * per:(g + 1) * per] = 0
        sel = sel + mask
    choice = sorted(range(len(sel)), key=lambda e: (-sel[e], e))[:k]
    w = scores[choice]
    if r["renormalize"] and k > 1:
        w = w / w.sum()
    return choice, w * r["scaling"]


def forward(p, cfg, tokens):
    T, C, H = cfg["seq_len"], cfg["d_model"], cfg["n_heads"]
    hs = C // H
    x = p["model.embed_tokens.weight"][tokens] + p["model.embed_positions.weight"][:T]
    causal = np.tril(np.ones((T, T), dtype=bool))
    ln_bias = cfg["norm"] == "layer_norm"
    for layer in range(cfg["n_layers"]):
        pre = "model.layers.%d." % layer
        b = (lambda n: p[pre + n]) if ln_bias else (lambda n: None)
        h = norm(x, p[pre + "input_layernorm.weight"], b("input_layernorm.bias"), cfg)
        qkv = h @ p[pre + "self_attn.qkv_proj.weight"].T + p[pre + "self_attn.qkv_proj.bias"]
        q, k, v = np.split(qkv, 3, axis=-1)
        out = np.zeros_like(q)
        for head in range(H):
            s = slice(head * hs, (head + 1) * hs)
            att = q[:, s] @ k[:, s].T / np.sqrt(hs)
            att = np.where(causal, att, -np.inf)
            att = np.exp(att - att.max(axis=-1, keepdims=True))
            att /= att.sum(axis=-1, keepdims=True)
            out[:, s] = att @ v[:, s]
        x = x + out @ p[pre + "self_attn.o_proj.weight"].T + p[pre + "self_attn.o_proj.bias"]
        h = norm(x, p[pre + "post_attention_layernorm.weight"], b("post_attention_layernorm.bias"), cfg)
        if layer in cfg["moe_layers"]:
            moe = cfg["moe"]
            r = moe["router"]
            if r["type"] == "expert_choice" or r.get("capacity_factor_eval", 0) > 0:
                fail("expert choice or capacity at evaluation depends on the whole batch; "
                     "not recomputed here")
            logits = h @ p[pre + "mlp.gate.weight"].T
            sel_bias = p[pre + "mlp.gate.e_score_correction_bias"] if r["selection_bias"] else None
            y = np.zeros_like(h)
            for t in range(T):
                choice, w = route(logits[t], sel_bias, r)
                for e, we in zip(choice, w):
                    y[t] += we * ffn(h[t:t + 1], p, pre + "mlp.experts.%d." % e, cfg, moe["expert_bias"])[0]
            if moe["shared_experts_width"] > 0:
                y += ffn(h, p, pre + "mlp.shared_experts.", cfg, moe["expert_bias"])
        else:
            y = ffn(h, p, pre + "mlp.", cfg, True)
        x = x + y
    x = norm(x, p["model.norm.weight"], p.get("model.norm.bias"), cfg)
    head = p["model.embed_tokens.weight"] if cfg["tie_embeddings"] else p["lm_head.weight"]
    return x @ head.T


def main():
    if len(sys.argv) != 6:
        fail("usage: safetensors_forward.py MODEL.safetensors CONFIG.json TOKENS.i32 B OUT.f32")
    params = read_safetensors(sys.argv[1])
    with open(sys.argv[2]) as f:
        cfg = json.load(f)
    B, T = int(sys.argv[4]), cfg["seq_len"]
    tokens = np.fromfile(sys.argv[3], dtype="<i4").reshape(B, T)
    logits = np.concatenate([forward(params, cfg, tokens[b]) for b in range(B)])
    logits.astype("<f4").tofile(sys.argv[5])


if __name__ == "__main__":
    main()
