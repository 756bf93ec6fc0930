#!/usr/bin/env python3
"""generate.py - a llama2.c checkpoint run in numpy, with pagedkv as its attention layer.

    python3 tools/python/generate.py --model ../shared/models/stories260K.bin \
        --tokenizer ../shared/models/tok512.bin -t 0 -n 256 -i "Once upon a time"

Token by token, with `pagedkv generate --model`'s options, ranges, defaults and
messages: -t 0 is greedy and its text equals the C tool's; with -t > 0 the sampler and
its random stream are the C tool's too (llama.c: xorshift64* coins, temperature, top-p).
The transformer is the one examples/llama/llama.c runs (RMSNorm with eps 1e-5, RoPE on
adjacent pairs with base 10000, grouped-query attention, SwiGLU feed-forward, the
classifier shared with the token embedding when the header's vocab_size is positive);
pagedkv keeps every layer's K/V in its paged cache and computes the attention.
docs/python.md walks through it.
"""
import argparse
import os
import re
import signal
import stat
import sys

import numpy as np

try:
    import pagedkv
except ImportError as exc:      # said by main() as a message, after --help and the options
    pagedkv, PAGEDKV_ERROR = None, exc

BOS = 1
RMS_EPS = np.float32(1e-5)
ROPE_BASE = 10000.0


# ---- the checkpoint (legacy llama2.c "version 0": 7 int32, then float32 tensors) ----
class BadFile(Exception):
    """A model or tokenizer file that cannot be used: the message says why."""


HEADER_FIELDS = ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size",
                 "seq_len")
HEADER_LIMITS = (1 << 16, 1 << 20, 1 << 12, 1 << 12, 1 << 12, 1 << 24, 1 << 24)
V1_MAGIC = 0x616b3432          # "ak42": llama2.c's version 1/2 exports


def read_file(path, what):
    """The bytes of a regular file. An OS error is raised as it is (FileNotFoundError,
    IsADirectoryError, PermissionError, ...: errno and filename set) with `what`
    ("model", "tokenizer") added; a file that is not regular (a FIFO, a device) is
    BadFile."""
    try:
        with open(path, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise BadFile(f"{what} '{path}' is not a regular file")
            return f.read()
    except OSError as exc:
        exc.what = what
        raise


def file_error(exc):
    """The C tool's message for an OS error of read_file."""
    if isinstance(exc, IsADirectoryError):
        return f"{exc.what} '{exc.filename}' is not a regular file"
    return f"cannot open {exc.what} '{exc.filename}': {exc.strerror}"


class Model:
    def __init__(self, path):
        raw = np.frombuffer(read_file(path, "model"), dtype="<u1")
        if raw.size < 28:
            raise BadFile(f"model '{path}' is truncated: {raw.size} bytes, less than the "
                          "28-byte header")
        h = [int(v) for v in raw[:28].view("<i4")]
        if h[0] == V1_MAGIC:
            raise BadFile(f"model '{path}' is a llama2.c version 1/2 export; only the "
                          "legacy version 0 format (export.py --version 0) is supported")
        for i, (name, limit) in enumerate(zip(HEADER_FIELDS, HEADER_LIMITS)):
            v = abs(h[i]) if i == 5 else h[i]
            if not 0 < v <= limit:
                raise BadFile(f"model '{path}' has a malformed header: header field {name} = "
                              f"{h[i]} is out of range 1..{limit}")
        (self.dim, self.hidden_dim, self.n_layers, self.n_heads, self.n_kv_heads,
         vocab, self.seq_len) = h
        shared = vocab > 0
        self.vocab_size = abs(vocab)
        bad = None
        if self.dim % self.n_heads:
            bad = f"dim {self.dim} is not a multiple of n_heads {self.n_heads}"
        elif (self.dim // self.n_heads) % 2:
            bad = f"head size {self.dim // self.n_heads} is odd (RoPE rotates pairs)"
        elif self.n_kv_heads > self.n_heads or self.n_heads % self.n_kv_heads:
            bad = f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}"
        if bad:
            raise BadFile(f"model '{path}' has a malformed header: {bad}")
        self.head_size = self.dim // self.n_heads
        kv_dim = self.n_kv_heads * self.head_size
        L, d, hid, V = self.n_layers, self.dim, self.hidden_dim, self.vocab_size
        floats = (V * d + L * d * 2 + L * d * d * 2 + L * kv_dim * d * 2 + L * hid * d * 3 +
                  d + self.seq_len * self.head_size + (0 if shared else V * d))
        if raw.size != 28 + 4 * floats:
            raise BadFile(
                f"model '{path}' has {raw.size} bytes but its header (dim {d}, hidden {hid}, "
                f"{L} layers, {self.n_heads}/{self.n_kv_heads} heads, vocab {V}, seq_len "
                f"{self.seq_len}) implies {28 + 4 * floats}: "
                f"{'truncated' if raw.size < 28 + 4 * floats else 'trailing bytes'}")
        w = raw[28:].view("<f4")

        def take(*shape):  # the next tensor, as a view of the file's floats
            nonlocal w
            n = int(np.prod(shape))
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
MAX_PIECE_BYTES = 4096


class Tokenizer:
    def __init__(self, path, vocab_size):
        data = read_file(path, "tokenizer")
        if len(data) > 256 << 20:
            raise BadFile(f"tokenizer '{path}' is implausibly large ({len(data)} bytes)")
        if len(data) < 4:
            raise BadFile(f"tokenizer '{path}' is truncated: {len(data)} bytes, no header")
        self.max_token_length = mtl = int(np.frombuffer(data, "<i4", 1, 0)[0])
        if not 0 < mtl <= MAX_PIECE_BYTES:
            raise BadFile(f"tokenizer '{path}': max_token_length {mtl} is not in "
                          f"1..{MAX_PIECE_BYTES}")
        self.pieces, self.scores, off = [], [], 4
        for i in range(vocab_size):
            if len(data) - off < 8:
                raise BadFile(f"tokenizer '{path}' is truncated: record {i} of {vocab_size} "
                              f"starts at byte {off} but the file has {len(data)} bytes")
            score = float(np.frombuffer(data, "<f4", 1, off)[0])
            n = int(np.frombuffer(data, "<i4", 1, off + 4)[0])
            if not np.isfinite(score):
                raise BadFile(f"tokenizer '{path}': piece {i} has a non-finite score")
            if not 0 < n <= mtl:
                raise BadFile(f"tokenizer '{path}': piece {i} has length {n} (must be "
                              f"1..{mtl}, the max_token_length)")
            if len(data) - off - 8 < n:
                raise BadFile(f"tokenizer '{path}' is truncated inside piece {i}")
            self.pieces.append(data[off + 8:off + 8 + n])
            self.scores.append(score)
            off += 8 + n
        if off != len(data):
            raise BadFile(f"tokenizer '{path}' has {len(data) - off} bytes after its "
                          f"{vocab_size} pieces: it does not belong to a model with "
                          f"vocab_size {vocab_size}")
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


# ---- the sampler: llama.c's, coin for coin ----------------------------------------
class Rng:
    """xorshift64*, as llama.c's llama_rng: coin() is a float in [0, 1) from the top 24
    bits of the next output."""
    MASK = (1 << 64) - 1

    def __init__(self, seed):
        self.s = seed or 0x9e3779b97f4a7c15

    def coin(self):
        s = self.s
        s ^= s >> 12
        s = (s ^ (s << 25)) & self.MASK
        s ^= s >> 27
        self.s = s
        return np.float32(((s * 0x2545f4914f6cdd1d) & self.MASK) >> 40) * np.float32(2**-24)


def sample(logits, temperature, topp, coin):
    """The next token: the first largest logit when temperature is 0, else a draw
    from softmax(logits / temperature), restricted to the top-p nucleus when
    0 < topp < 1 (llama.c's llama_sample, in float32 and in its order of sums)."""
    if temperature == 0:
        return int(np.argmax(logits))
    p = logits.astype(np.float32) / np.float32(temperature)
    p = np.exp(p - p.max())
    p /= np.cumsum(p)[-1]                               # the sum in C's order
    if topp <= 0 or topp >= 1:
        i = int(np.searchsorted(np.cumsum(p), coin, side="right"))
        return min(i, p.size - 1)
    n = p.size
    cutoff = (np.float32(1) - np.float32(topp)) / np.float32(max(n - 1, 1))
    idx = np.flatnonzero(p >= cutoff)
    if idx.size == 0:
        return int(np.argmax(p))
    idx = idx[np.lexsort((idx, -p[idx]))]              # probability down, then id up
    cum = np.cumsum(p[idx])
    over = np.flatnonzero(cum > np.float32(topp))
    last = int(over[0]) if over.size else idx.size - 1
    r = coin * cum[last]
    i = int(np.searchsorted(cum[:last + 1], r, side="right"))
    return int(idx[min(i, last)])


def encode_bytes(text):
    """Without a tokenizer: BOS, then each byte b of the prompt as token b + 3."""
    return [BOS] + [b + 3 for b in text.encode()]


def generate(model, tok, prompt, steps, out, dtype="f32", block_tokens=0, temperature=0.0,
             topp=0.9, seed=42):
    """Generation of `steps` positions (prompt included), greedy at temperature 0;
    writes the text's bytes (without a tokenizer: the ids) to `out` as they come and
    returns the token ids."""
    prompt_ids = tok.encode(prompt) if tok else encode_bytes(prompt)
    rng = Rng(seed)
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
                coin = rng.coin() if temperature > 0 else 0.0
                nxt = sample(logits, temperature, topp, coin)
                if nxt == BOS:
                    break
            if tok:
                out.write(tok.decode(token, nxt))
            else:
                out.write(b"%s%d" % (b" " if len(ids) > 1 else b"", nxt))
            out.flush()
            ids.append(nxt)
            token = nxt
        out.write(b"\n")
        out.flush()
    return ids


# ---- the command line: pagedkv generate's options, ranges and messages --------------
class Parser(argparse.ArgumentParser):
    def error(self, message):
        # "argument -n/--steps: ..." -> "-n: ...", as the C tool says it
        message = re.sub(r"^argument (-\w)(/--[\w-]+)?: ", r"\1: ", message)
        message = re.sub(r"^argument (--[\w-]+): ", r"\1: ", message)
        message = re.sub(r"^unrecognized arguments: (\S+).*", r"unknown option '\1'", message)
        self.exit(2, f"{self.prog}: {message}\nTry '{self.prog} --help'.\n")


def integer(lo, hi):
    def parse(text):
        try:
            v = int(text, 10)
        except ValueError:
            v = None
        if v is None or not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"'{text}' is not an integer in {lo}..{hi}")
        return v
    return parse


def number(lo, hi):
    def parse(text):
        try:
            v = float(text)
        except ValueError:
            v = None
        if v is None or not lo <= v <= hi:                  # NaN fails too
            raise argparse.ArgumentTypeError(f"'{text}' is not a number in {lo:g}..{hi:g}")
        return v
    return parse


def dtype(text):
    if text not in ("f32", "f16", "bf16", "q8", "q4"):
        raise argparse.ArgumentTypeError(f"'{text}' is not f32, f16, bf16, q8 or q4")
    return text


def main(argv=None):
    ap = Parser(prog=os.path.basename(sys.argv[0]) if argv is None else "generate.py",
                description=__doc__.split("\n\n")[0],
                epilog="Generation stops after -n positions or when the model emits BOS "
                       "(token 1). Text goes to stdout.")
    ap.add_argument("--model", required=True, metavar="FILE",
                    help="llama2.c checkpoint (legacy version-0 format)")
    ap.add_argument("--tokenizer", metavar="FILE",
                    help="llama2.c tokenizer; without one, tokens print as ids (the "
                         "prompt's, then the generated ones; never BOS)")
    ap.add_argument("-n", "--steps", type=integer(1, 2**32 - 1), default=256, metavar="N",
                    help="positions to run, prompt included (default 256; at most the "
                         "model's seq_len)")
    ap.add_argument("-i", "--prompt", default="", metavar="TEXT",
                    help="prompt (default empty: BOS alone). Without a tokenizer each byte "
                         "b is token b+3")
    ap.add_argument("-t", "--temperature", type=number(0, 1e6), default=1.0, metavar="T",
                    help="0 = greedy (default 1.0)")
    ap.add_argument("-p", "--top-p", type=number(0, 1), default=0.9, metavar="P",
                    help="nucleus sampling mass in (0,1); 0 or 1 = off (default 0.9)")
    ap.add_argument("-s", "--seed", type=integer(0, 2**64 - 1), default=42, metavar="S",
                    help="sampler seed (default 42)")
    ap.add_argument("--dtype", type=dtype, default="f32", metavar="D",
                    help="KV storage: f32, f16, bf16, q8, q4 (default f32)")
    ap.add_argument("--block-tokens", type=integer(1, 2**32 - 1), default=0, metavar="B",
                    help="tokens per page (default: the library's, 16)")
    a = ap.parse_args(argv)
    if pagedkv is None:
        print(f"{ap.prog}: {PAGEDKV_ERROR}", file=sys.stderr)
        return 1
    # `| head` closes stdout early: end quietly as the C tool does (SIGPIPE)
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    try:
        model = Model(a.model)
        tok = Tokenizer(a.tokenizer, model.vocab_size) if a.tokenizer else None
    except BadFile as exc:
        print(f"{ap.prog}: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"{ap.prog}: {file_error(exc)}", file=sys.stderr)
        return 1
    if tok is None and a.prompt and model.vocab_size < 259:
        ap.error("a prompt without --tokenizer needs a vocabulary of at least 259 (byte "
                 "tokens)")
    steps = a.steps
    if steps > model.seq_len:
        print(f"{ap.prog}: -n {steps} exceeds the model's seq_len; using {model.seq_len}",
              file=sys.stderr)
        steps = model.seq_len
    try:
        generate(model, tok, a.prompt, steps, sys.stdout.buffer, a.dtype, a.block_tokens,
                 a.temperature, a.top_p, a.seed)
    except pagedkv.Error as exc:
        print(f"{ap.prog}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
