#!/usr/bin/env python3
"""generate.py - a llama2.c checkpoint run in numpy, with pagedkv as its attention layer.

    python3 tools/python/generate.py --model ../shared/models/stories260K.bin \
        --tokenizer ../shared/models/tok512.bin -n 256 -i "Once upon a time"

Greedy decoding, token by token: the text equals `pagedkv generate ... -t 0`'s. The
transformer is the one examples/llama/llama.c runs (RMSNorm with eps 1e-5, RoPE on
adjacent pairs with base 10000, grouped-query attention, SwiGLU feed-forward, the
classifier shared with the token embedding when the header's vocab_size is positive);
pagedkv keeps every layer's K/V in its paged cache and computes the attention.
docs/python.md walks through it.
"""
import argparse
import sys

import numpy as np

import pagedkv

BOS = 1
RMS_EPS = np.float32(1e-5)
ROPE_BASE = 10000.0


# ---- the checkpoint (legacy llama2.c "version 0": 7 int32, then float32 tensors) ----
class Model:
    def __init__(self, path):
        raw = np.fromfile(path, dtype="<u1")
        (self.dim, self.hidden_dim, self.n_layers, self.n_heads, self.n_kv_heads,
         vocab, self.seq_len) = (int(v) for v in raw[:28].view("<i4"))
        shared = vocab > 0
        self.vocab_size = abs(vocab)
        self.head_size = self.dim // self.n_heads
        kv_dim = self.n_kv_heads * self.head_size
        w = raw[28:].view("<f4")
        L, d, hid, V = self.n_layers, self.dim, self.hidden_dim, self.vocab_size

        def take(*shape):  # the next tensor, as a view of the file's floats
            nonlocal w
            n = int(np.prod(shape))
            if w.size < n:
                raise ValueError(f"{path}: the file ends inside its tensors")
            t, w = w[:n].reshape(shape), w[n:]
            return t

        self.token_embedding = take(V, d)               # (vocab, dim)
        self.rms_att = take(L, d)                       # (layer, dim)
        self.wq = take(L, d, d)                         # (layer, dim out, dim in)
        self.wk = take(L, kv_dim, d)                    # (layer, kv_dim, dim)
        self.wv = take(L, kv_dim, d)
        self.wo = take(L, d, d)
        self.rms_ffn = take(L, d)
        self.w1 = take(L, hid, d)                       # gate
        self.w2 = take(L, d, hid)                       # down
        self.w3 = take(L, hid, d)                       # up
        self.rms_final = take(d)
        take(self.seq_len, self.head_size // 2)         # legacy RoPE tables, unused
        take(self.seq_len, self.head_size // 2)
        self.wcls = self.token_embedding if shared else take(V, d)
        # RoPE: pair i of every head turns by pos * base^(-2i/head_size)
        i = np.arange(self.head_size // 2, dtype=np.float32)
        self.rope_freq = (1.0 / np.power(np.float32(ROPE_BASE),
                                         2 * i / np.float32(self.head_size))).astype(np.float32)


# ---- the tokenizer (llama2.c tok*.bin: max_token_length, then score, len, bytes) ----
class Tokenizer:
    def __init__(self, path, vocab_size):
        data = open(path, "rb").read()
        self.max_token_length = int(np.frombuffer(data, "<i4", 1, 0)[0])
        self.pieces, self.scores, off = [], [], 4
        for _ in range(vocab_size):
            score = float(np.frombuffer(data, "<f4", 1, off)[0])
            n = int(np.frombuffer(data, "<i4", 1, off + 4)[0])
            self.pieces.append(data[off + 8:off + 8 + n])
            self.scores.append(score)
            off += 8 + n
        self.ids = {p: i for i, p in enumerate(self.pieces)}

    def byte_of(self, tok):
        p = self.pieces[tok]
        if len(p) == 6 and p.startswith(b"<0x") and p.endswith(b">"):
            try:
                return int(p[3:5], 16)
            except ValueError:
                return None
        return None

    def encode(self, text):
        """BOS, a " " dummy prefix for non-empty text, one piece (or its bytes + 3) per
        code point, then the best-scoring adjacent merges, leftmost first on ties."""
        raw = text.encode()
        out = [BOS]
        if raw:
            out.append(self.ids.get(b" ", ord(" ") + 3))
        i = 0
        while i < len(raw):
            start = i
            i += 1
            while i < len(raw) and i - start < 4 and (raw[i] & 0xC0) == 0x80:
                i += 1
            cp = raw[start:i]
            if cp in self.ids:
                out.append(self.ids[cp])
            else:
                out.extend(b + 3 for b in cp)
        while True:
            best, best_id, best_at = -np.inf, -1, 0
            for j in range(len(out) - 1):
                merged = self.pieces[out[j]] + self.pieces[out[j + 1]]
                mid = self.ids.get(merged)
                if mid is not None and self.scores[mid] > best:
                    best, best_id, best_at = self.scores[mid], mid, j
            if best_id < 0:
                return out
            out[best_at:best_at + 2] = [best_id]

    def decode(self, prev, tok):
        """The bytes token `tok` prints after `prev`."""
        p = self.pieces[tok]
        if prev == BOS and p.startswith(b" "):
            p = p[1:]
        b = self.byte_of(tok)
        if b is not None:
            p = bytes([b])
        if len(p) == 1 and p[0] < 0x80 and not (chr(p[0]).isprintable() or chr(p[0]).isspace()):
            return b""
        return p


# ---- the forward pass: one token at `pos`, attention in pagedkv --------------------
def rmsnorm(x, weight):
    ss = np.mean(x * x, dtype=np.float32)
    return (x * (np.float32(1.0) / np.sqrt(ss + RMS_EPS))) * weight


def rope(v, n_heads, head_size, pos, freq):
    """Rotate adjacent pairs (2i, 2i+1) of every head of v [n_heads * head_size]."""
    ang = np.float32(pos) * freq
    cos, sin = np.cos(ang), np.sin(ang)
    p = v.reshape(n_heads, head_size // 2, 2)
    a, b = p[..., 0].copy(), p[..., 1].copy()
    p[..., 0] = a * cos - b * sin
    p[..., 1] = a * sin + b * cos


def forward(m, session, token, pos):
    hs = m.head_size
    x = m.token_embedding[token].copy()                              # (dim,)
    for l in range(m.n_layers):
        xb = rmsnorm(x, m.rms_att[l])
        q = m.wq[l] @ xb                                             # (n_heads * hs,)
        k = m.wk[l] @ xb                                             # (n_kv_heads * hs,)
        v = m.wv[l] @ xb
        rope(q, m.n_heads, hs, pos, m.rope_freq)
        rope(k, m.n_kv_heads, hs, pos, m.rope_freq)
        # the attention layer: K/V into the paged cache, one decode over positions 0..pos
        session.append(l, k.reshape(m.n_kv_heads, hs), v.reshape(m.n_kv_heads, hs))
        att = session.decode(l, q.reshape(m.n_heads, hs))           # (n_heads, hs)
        x += m.wo[l] @ att.reshape(-1)
        xb = rmsnorm(x, m.rms_ffn[l])
        g = m.w1[l] @ xb                                             # (hidden,)
        g = g * (np.float32(1.0) / (np.float32(1.0) + np.exp(-g)))   # silu
        x += m.w2[l] @ (g * (m.w3[l] @ xb))
    return m.wcls @ rmsnorm(x, m.rms_final)                          # (vocab,) logits


def generate(model, tok, prompt, steps, out, dtype="f32", block_tokens=0):
    """Greedy generation of `steps` positions (prompt included); writes the text's bytes
    to `out` as they come and returns the token ids."""
    prompt_ids = tok.encode(prompt)
    with pagedkv.Engine(n_layers=model.n_layers, n_heads=model.n_heads,
                        n_kv_heads=model.n_kv_heads, head_dim=model.head_size,
                        kv_dtype=dtype, block_tokens=block_tokens) as engine, \
            engine.session() as session:
        token, ids = prompt_ids[0], [prompt_ids[0]]
        for pos in range(steps):
            logits = forward(model, session, token, pos)
            if pos + 1 < len(prompt_ids):
                nxt = prompt_ids[pos + 1]
            else:
                nxt = int(np.argmax(logits))                         # first of ties
                if nxt == BOS:
                    break
            out.write(tok.decode(token, nxt))
            out.flush()
            ids.append(nxt)
            token = nxt
        out.write(b"\n")
        out.flush()
    return ids


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="llama2.c checkpoint (version 0)")
    ap.add_argument("--tokenizer", required=True, help="llama2.c tokenizer (tok*.bin)")
    ap.add_argument("-n", "--steps", type=int, default=256,
                    help="positions to run, prompt included (default 256)")
    ap.add_argument("-i", "--prompt", default="", help="prompt (default empty: BOS alone)")
    ap.add_argument("--dtype", default="f32", help="KV storage: f32 (default), f16, bf16")
    ap.add_argument("--block-tokens", type=int, default=0, help="tokens per page")
    a = ap.parse_args(argv)
    model = Model(a.model)
    tok = Tokenizer(a.tokenizer, model.vocab_size)
    steps = a.steps
    if steps <= 0 or steps > model.seq_len:
        print(f"generate.py: -n {steps}: using the model's seq_len {model.seq_len}",
              file=sys.stderr)
        steps = model.seq_len
    generate(model, tok, a.prompt, steps, sys.stdout.buffer, a.dtype, a.block_tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
