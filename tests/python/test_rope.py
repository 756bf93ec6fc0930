"""The engine's RoPE through the package: Engine.rope_q and Session.discard against a
reference written here in plain Python floats (doubles, the math module; no numpy in
the reference), within docs/rope.md's bounds; bad ranges raise the exception of their
status and change nothing."""
import math
import unittest

import pkvtest
from pkvtest import np, rng

import pagedkv

H, G, D, BT = 4, 2, 16, 4
# layer 0: adjacent pairs over the whole head, the defaults; layer 1: split halves over
# half of it (partial rotation), Llama 3's theta, linear scaling
LAYERS = [{"rope": "norm"},
          {"rope": "neox", "rope_dims": 8, "rope_theta": 500000.0, "rope_freq_scale": 0.5}]

# docs/rope.md: each rotated pair is within 2^-20 of its norm below position 2^24
PAIR_BOUND = 2.0 ** -20


# ---- the reference: plain Python doubles ----------------------------------------------

def pairs(cfg, d=D):
    """[(index of x, index of y, f_i)] of a head: the pairs the layer rotates."""
    rd = cfg.get("rope_dims", 0) or d
    theta = cfg.get("rope_theta", 0.0) or 10000.0
    scale = cfg.get("rope_freq_scale", 0.0) or 1.0
    half = rd // 2
    out = []
    for i in range(half):
        f = scale * theta ** (-(2.0 * i) / rd)
        if cfg["rope"] == "norm":
            out.append((2 * i, 2 * i + 1, f))
        else:
            out.append((i, i + half, f))
    return out


def rotate(cfg, head, p):
    """One head (a list of floats) turned by the exact angles p * f_i, in double."""
    y = [float(v) for v in head]
    for i0, i1, f in pairs(cfg, len(head)):
        c, s = math.cos(p * f), math.sin(p * f)
        a, b = float(head[i0]), float(head[i1])
        y[i0] = a * c - b * s
        y[i1] = a * s + b * c
    return y


def attend(q, keys, values, scale):
    """q [h][d] over rows keys [n][g][d], values [n][g][dv], query head i reading group
    i // (h // g): [h][dv] in double."""
    h, g = len(q), len(keys[0])
    out = []
    for i in range(h):
        grp = i // (h // g)
        s = [scale * sum(a * b for a, b in zip(q[i], k[grp])) for k in keys]
        m = max(s)
        w = [math.exp(x - m) for x in s]
        tot = sum(w)
        dv = len(values[0][grp])
        out.append([sum(w[j] * values[j][grp][c] for j in range(len(w))) / tot
                    for c in range(dv)])
    return out


def norm(v):
    return math.sqrt(sum(float(x) * float(x) for x in v))


def as_lists(a):
    return [[float(x) for x in row] for row in a]


class RopeQ(unittest.TestCase):
    def test_rope_q_against_exact_rotation(self):
        positions = [0, 1, 5, 63, 64, 65, 4095, 4096, 262145, (1 << 24) - 1]
        r = rng(48)
        with pagedkv.Engine(n_layers=3, n_heads=H, n_kv_heads=G, head_dim=D,
                            layer_cfg=LAYERS + [{}]) as e:
            q = r.standard_normal((len(positions), H, D), dtype=np.float32)
            for layer, cfg in enumerate(LAYERS):
                got = e.rope_q(layer, q, positions)
                self.assertEqual(got.dtype, np.float32)
                self.assertEqual(got.shape, q.shape)
                rotated = {i for i0, i1, _ in pairs(cfg) for i in (i0, i1)}
                for j, p in enumerate(positions):
                    for hh in range(H):
                        x = [float(v) for v in q[j, hh]]
                        want = rotate(cfg, x, p)
                        for i0, i1, _ in pairs(cfg):
                            err = math.hypot(float(got[j, hh, i0]) - want[i0],
                                             float(got[j, hh, i1]) - want[i1])
                            self.assertLessEqual(
                                err, PAIR_BOUND * math.hypot(x[i0], x[i1]) + 1e-30,
                                f"layer {layer} pos {p} head {hh} pair ({i0}, {i1})")
                        for i in set(range(D)) - rotated:   # past rope_dims: unchanged
                            self.assertEqual(got[j, hh, i], q[j, hh, i])
            # a layer without rope: the queries come back as they were; the input is
            # never written
            q0 = q.copy()
            self.assertTrue(np.array_equal(e.rope_q(2, q, positions), q))
            self.assertTrue(np.array_equal(q, q0))
            with self.assertRaises(pagedkv.InvalidArgument):
                e.rope_q(3, q, positions)                    # no such layer
            with self.assertRaises(ValueError):
                e.rope_q(0, q, positions[:-1])               # rows and positions differ


class Discard(unittest.TestCase):
    def setUp(self):
        r = rng(4800)
        self.T = 30
        self.k = r.standard_normal((self.T + 12, G, D), dtype=np.float32)
        self.v = r.standard_normal((self.T + 12, G, D), dtype=np.float32)
        self.q = r.standard_normal((self.T + 12, H, D), dtype=np.float32)

    def tolerance(self, q_rows, k_rows, shifts, scale, vmax):
        """docs/rope.md: the usual decode bound over exactly rotated rows (the one
        test_attention holds f32 decode to) plus the scores' error from the rotations:
        2^-20 of |q| for the query's, 2^-20 of |k| for the key's and one more for each
        re-rotation it went through (f32: the drift table's per-shift figure is below
        that); a score error ds moves the softmax average by at most 2 ds max|v|."""
        qn = max(norm(h) for row in q_rows for h in row)
        kn = max(norm(g) for row in k_rows for g in row)
        ds = scale * qn * kn * (2 + shifts) * PAIR_BOUND
        return 1e-5 * max(1.0, vmax) + 2 * ds * vmax

    def test_decode_after_discards(self):
        e = pagedkv.Engine(n_layers=2, n_heads=H, n_kv_heads=G, head_dim=D, block_tokens=BT,
                           layer_cfg=LAYERS)
        with e, e.session() as s:
            scale = e.scale
            vmax = float(np.max(np.abs(self.v)))
            # which raw row sits at each position, where it was stored, and how many
            # shifts it went through
            rows, stored, moved = list(range(self.T)), list(range(self.T)), [0] * self.T
            for t in range(self.T):
                for layer in range(2):
                    s.append(layer, self.k[t], self.v[t])
            fork = s.fork()   # shares every page: the discard must copy before moving
            nxt = self.T
            # an unaligned cut, then a page-aligned one (block_tokens 4), then one that
            # takes the last rows and moves nothing
            for p0, p1 in ((5, 13), (8, 12), (s.len(0) - 14 - 3, s.len(0) - 14)):
                s.discard(p0, p1)
                moved = moved[:p0] + [m + 1 for m in moved[p1:]]
                rows, stored = rows[:p0] + rows[p1:], stored[:p0] + stored[p1:]
                for layer in range(2):
                    self.assertEqual(s.len(layer), len(rows))
                for _ in range(3):   # the next tokens: appended at len, queries at len
                    pos = len(rows)
                    rows.append(nxt)
                    stored.append(pos)
                    moved.append(0)
                    for layer, cfg in enumerate(LAYERS):
                        s.append(layer, self.k[nxt], self.v[nxt])
                        qr = e.rope_q(layer, self.q[nxt][None], [pos])[0]
                        out = s.decode(layer, qr)
                        qx = [rotate(cfg, as_lists(self.q[nxt])[i], pos) for i in range(H)]
                        keys = [[rotate(cfg, list(self.k[row][g]), j) for g in range(G)]
                                for j, row in enumerate(rows)]
                        vals = [as_lists(self.v[row]) for row in rows]
                        want = attend(qx, keys, vals, scale)
                        err = max(abs(float(out[i][c]) - want[i][c])
                                  for i in range(H) for c in range(D))
                        tol = self.tolerance([self.q[nxt]], [self.k[row] for row in rows],
                                             max(moved), scale, vmax)
                        self.assertLessEqual(err, tol, f"after discard({p0}, {p1}), "
                                             f"layer {layer}, position {pos}")
                        # the check can fail: keys left at their old positions (no
                        # re-rotation) are far outside it, as soon as any row moved
                        if max(moved):
                            stale = [[rotate(cfg, list(self.k[row][g]), at) for g in range(G)]
                                     for row, at in zip(rows, stored)]
                            old = attend(qx, stale, vals, scale)
                            far = max(abs(float(out[i][c]) - old[i][c])
                                      for i in range(H) for c in range(D))
                            self.assertGreater(far, 100 * tol)
                    nxt += 1
            # the fork still holds the original rows at their original positions
            self.assertEqual(fork.len(0), self.T)
            pos = self.T - 1
            for layer, cfg in enumerate(LAYERS):
                qr = e.rope_q(layer, self.q[pos][None], [pos])[0]
                out = fork.decode(layer, qr)
                qx = [rotate(cfg, as_lists(self.q[pos])[i], pos) for i in range(H)]
                keys = [[rotate(cfg, list(self.k[j][g]), j) for g in range(G)]
                        for j in range(self.T)]
                want = attend(qx, keys, [as_lists(self.v[j]) for j in range(self.T)], scale)
                err = max(abs(float(out[i][c]) - want[i][c]) for i in range(H) for c in range(D))
                self.assertLessEqual(err, self.tolerance([self.q[pos]], self.k[:self.T], 0,
                                                         scale, vmax))
            fork.close()

    def unchanged(self, s, layers, q, before):
        for layer in range(layers):
            self.assertEqual(s.len(layer), before[layer][0])
            self.assertTrue(np.array_equal(s.decode(layer, q), before[layer][1]),
                            f"layer {layer} decodes differently after a refused discard")

    def test_bad_ranges_change_nothing(self):
        # layer 1 has no rope: its keys cannot be re-rotated
        e = pagedkv.Engine(n_layers=2, n_heads=H, n_kv_heads=G, head_dim=D, block_tokens=BT,
                           layer_cfg=[LAYERS[0], {}])
        with e, e.session() as s:
            n = 21
            for t in range(n):
                s.append(0, self.k[t], self.v[t])
            for t in range(n - 4):        # layer 1 shorter: positions [0, 17)
                s.append(1, self.k[t], self.v[t])
            q = self.q[0]
            before = [(s.len(layer), s.decode(layer, q).copy()) for layer in range(2)]
            cases = [
                ((6, 5), pagedkv.InvalidArgument, pagedkv.EINVAL),    # p0 > p1
                ((0, n + 1), pagedkv.OutOfRange, pagedkv.ERANGE),     # past every layer
                ((n + 1, n + 1), pagedkv.OutOfRange, pagedkv.ERANGE),
                ((3, (1 << 64) - 1), pagedkv.OutOfRange, pagedkv.ERANGE),
                ((3, 9), pagedkv.InvalidArgument, pagedkv.EINVAL),    # layer 1 moves, no rope
            ]
            for (p0, p1), exc, status in cases:
                with self.subTest(p0=p0, p1=p1):
                    with self.assertRaises(exc) as cm:
                        s.discard(p0, p1)
                    self.assertIsInstance(cm.exception, ValueError)
                    self.assertEqual(cm.exception.status, status)
                    self.assertIn("discard", str(cm.exception))
                    self.unchanged(s, 2, q, before)
            # the no-rope case says why
            with self.assertRaisesRegex(pagedkv.InvalidArgument, "rope"):
                s.discard(3, 9)
            # nothing to do: p0 == p1 within the longest layer
            s.discard(n, n)
            s.discard(4, 4)
            self.unchanged(s, 2, q, before)
            # a cut at or past the no-rope layer's end moves none of its rows: allowed
            # (that layer is truncated to p0, the rope layer re-rotates its last rows)
            s.discard(17, 19)
            self.assertEqual((s.len(0), s.len(1)), (n - 2, 17))
            # a closed session refuses the call (the package's ValueError)
            s.close()
            with self.assertRaisesRegex(ValueError, "closed"):
                s.discard(0, 1)


    def test_window_refuses_released_rows(self):
        # a window of 8: a discard that would bring positions the window released back
        # into the new window is OutOfRange, nothing changed; one below the window's
        # start just drops what it had released (docs/rope.md, "Windows")
        e = pagedkv.Engine(n_layers=1, n_heads=H, n_kv_heads=G, head_dim=D, block_tokens=BT,
                           layer_cfg=[dict(LAYERS[1], window=8)])
        with e, e.session() as s:
            for t in range(30):
                s.append(0, self.k[t], self.v[t])
            q = e.rope_q(0, self.q[29][None], [29])[0]
            before = [(s.len(0), s.decode(0, q).copy())]
            for p0, p1 in ((20, 24), (25, 30)):
                with self.subTest(p0=p0, p1=p1):
                    with self.assertRaisesRegex(pagedkv.OutOfRange, "released") as cm:
                        s.discard(p0, p1)
                    self.assertEqual(cm.exception.status, pagedkv.ERANGE)
                    self.unchanged(s, 1, q, before)
            s.discard(2, 6)
            self.assertEqual(s.len(0), 26)
            # the window's rows moved down by 4 and were turned back by 4: a query at 25
            # reads rows 22..29 as they would be at 18..25
            pos = 25
            qr = e.rope_q(0, self.q[29][None], [pos])[0]
            out = s.decode(0, qr)
            cfg = LAYERS[1]
            qx = [rotate(cfg, as_lists(self.q[29])[i], pos) for i in range(H)]
            rows = list(range(22, 30))
            keys = [[rotate(cfg, list(self.k[row][g]), row - 4) for g in range(G)]
                    for row in rows]
            want = attend(qx, keys, [as_lists(self.v[row]) for row in rows], e.scale)
            err = max(abs(float(out[i][c]) - want[i][c]) for i in range(H) for c in range(D))
            tol = self.tolerance([self.q[29]], [self.k[row] for row in rows], 1, e.scale,
                                 float(np.max(np.abs(self.v[22:30]))))
            self.assertLessEqual(err, tol)

if __name__ == "__main__":
    pkvtest.run()
