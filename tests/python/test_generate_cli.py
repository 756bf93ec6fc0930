"""tools/python/generate.py as a command: the options, ranges, defaults and messages of
`pagedkv generate --model`, side by side with the C tool on small checkpoints and
tokenizers this test writes (valid ones with random weights, and broken ones): the
same text for greedy and sampled runs and without a tokenizer (ids), a refused option
is the same one-line message and exit status 2, a bad file is the same message (and
the OS's reason) with status 1, never a traceback, and `| head` ends it quietly by
SIGPIPE, as it ends the C tool."""
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import unittest

import pkvtest
from pkvtest import np

SRC = os.environ.get("PKV_SRCDIR", os.path.join(os.path.dirname(__file__), "..", ".."))
TOOL = os.environ.get("PKV_TOOL", os.path.join(SRC, "build", "tools", "pagedkv"))
GENERATE = os.path.join(SRC, "tools", "python", "generate.py")

if not os.access(TOOL, os.X_OK):
    print(f"SKIP: no pagedkv tool at {TOOL}")
    sys.exit(77)


def write_model(path, dim=16, hidden=32, layers=2, heads=4, kv_heads=2, vocab=300,
                seq_len=64, seed=0, extra=b""):
    """A llama2.c version-0 checkpoint with random weights (shared classifier)."""
    hs = dim // heads
    kv = kv_heads * hs
    n = (vocab * dim + layers * dim * 2 + layers * dim * dim * 2 + layers * kv * dim * 2 +
         layers * hidden * dim * 3 + dim + seq_len * hs)
    w = np.random.default_rng(seed).uniform(-0.5, 0.5, n).astype("<f4")
    w[vocab * dim:vocab * dim + layers * dim] = 1.0           # rms_att weights
    with open(path, "wb") as f:
        f.write(np.array([dim, hidden, layers, heads, kv_heads, vocab, seq_len],
                         dtype="<i4").tobytes())
        f.write(w.tobytes() + extra)


def write_tokenizer(path, vocab=300, pieces=None):
    """tok*.bin: max_token_length, then per piece score, length, bytes."""
    pieces = pieces or ([b"<unk>", b"<s>", b"</s>"] +
                        [bytes([97 + i % 26]) * (1 + i // 26) for i in range(vocab - 3)])
    with open(path, "wb") as f:
        f.write(np.array([max(map(len, pieces))], "<i4").tobytes())
        for i, p in enumerate(pieces):
            f.write(np.array([-float(i)], "<f4").tobytes())
            f.write(np.array([len(p)], "<i4").tobytes() + p)


def c_run(*args):
    return subprocess.run([TOOL, "generate", "--threads", "1", *args], capture_output=True)


def py_run(*args, **kw):
    return subprocess.run([sys.executable, GENERATE, *args], capture_output=True, **kw)


def body(stderr, prog):
    """The message of a one-line error, without its program name."""
    first = stderr.decode().splitlines()[0]
    assert first.startswith(prog + ": "), first
    return first[len(prog) + 2:]


class Cli(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        d = cls.tmp.name
        cls.model = os.path.join(d, "model.bin")
        cls.tok = os.path.join(d, "tok.bin")
        write_model(cls.model)
        write_tokenizer(cls.tok)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def test_same_text_greedy_sampled_and_ids(self):
        cases = [["-t", "0", "-n", "40", "-i", "abc"], ["-n", "50"],          # default: -t 1
                 ["-t", "0.7", "-s", "9", "-n", "64", "-i", "ab"],
                 ["-t", "1", "-p", "0", "-s", "3", "-n", "30"],
                 ["-t", "1.5", "-p", "0.5", "-s", "0", "-n", "60", "--dtype", "f16",
                  "--block-tokens", "4"]]
        for args in cases[:2] if pkvtest.QUICK else cases:   # sanitizer runs: QUICK
            for tok in (["--tokenizer", self.tok], []):
                with self.subTest(args=args, tokenizer=bool(tok)):
                    want = c_run("--model", self.model, *tok, *args)
                    got = py_run("--model", self.model, *tok, *args)
                    self.assertEqual(want.returncode, 0, want.stderr)
                    self.assertEqual(got.returncode, 0, got.stderr)
                    self.assertGreater(len(want.stdout), 5)
                    self.assertEqual(got.stdout, want.stdout)

    def test_refused_options(self):
        for args in (["-n", "0"], ["-n", "-3"], ["-n", "abc"], ["-n", str(2**32)],
                     ["-t", "-1"], ["-t", "1e7"], ["-t", "nan"], ["-p", "1.5"],
                     ["-p", "-0.1"], ["-s", "-1"], ["-s", str(2**64)],
                     ["--dtype", "q9"], ["--block-tokens", "0"], ["--bogus"]):
            with self.subTest(args=args):
                want = c_run("--model", self.model, *args)
                got = py_run("--model", self.model, *args)
                self.assertEqual((got.returncode, want.returncode), (2, 2))
                self.assertNotIn(b"Traceback", got.stderr)
                self.assertEqual(body(got.stderr, "generate.py"),
                                 body(want.stderr, "pagedkv generate"))
                self.assertEqual(got.stdout, b"")
        small = os.path.join(self.tmp.name, "small.bin")
        write_model(small, vocab=40)
        want = c_run("--model", small, "-i", "ab")
        got = py_run("--model", small, "-i", "ab")
        self.assertEqual((got.returncode, want.returncode), (2, 2))
        self.assertEqual(body(got.stderr, "generate.py"), body(want.stderr, "pagedkv generate"))

    def test_bad_files(self):
        d = self.tmp.name
        paths = {}

        def bad(name, data):
            paths[name] = os.path.join(d, name)
            with open(paths[name], "wb") as f:
                f.write(data)
            return paths[name]

        with open(self.model, "rb") as f:
            good = f.read()
        cases = [
            (["--model", os.path.join(d, "missing.bin")], "No such file or directory"),
            (["--model", d], None),                                         # a directory
            (["--model", bad("text.bin", b"this is not a checkpoint at all" * 3)], None),
            (["--model", bad("short.bin", good[:20])], None),
            (["--model", bad("cut.bin", good[:-8])], None),
            (["--model", bad("long.bin", good + b"\0" * 8)], None),
            (["--model", bad("v1.bin", np.array([0x616b3432, 1], "<i4").tobytes() +
                             b"\0" * 300)], None),
            (["--model", self.model, "--tokenizer", os.path.join(d, "missing.tok")],
             "No such file or directory"),
            (["--model", self.model, "--tokenizer", bad("bad.tok", b"\xff\xff\xff\x7f")],
             None),
            (["--model", self.model, "--tokenizer", bad("cut.tok", b"\x04\0\0\0" +
                                                        b"\0" * 10)], None),
        ]
        write_tokenizer(os.path.join(d, "small.tok"), vocab=10)
        cases.append((["--model", self.model, "--tokenizer", os.path.join(d, "small.tok")],
                      None))
        for args, reason in cases:
            with self.subTest(args=args):
                want = c_run(*args)
                got = py_run(*args)
                self.assertEqual((got.returncode, want.returncode), (1, 1), got.stderr)
                self.assertNotIn(b"Traceback", got.stderr)
                self.assertEqual(len(got.stderr.decode().splitlines()), 1, got.stderr)
                msg = body(got.stderr, "generate.py")
                self.assertTrue(msg.startswith(body(want.stderr, "pagedkv generate")),
                                (msg, want.stderr))
                if reason:
                    self.assertTrue(msg.endswith(": " + reason), msg)

    def test_file_errors_are_oserrors(self):
        # generate.py as a module: Model and Tokenizer raise the OS's exception, errno
        # and filename set (PermissionError as user nobody when run as root)
        code = textwrap.dedent("""
            import errno, os, sys
            sys.path.insert(0, os.path.dirname(sys.argv[1]))
            import generate
            d = sys.argv[2]
            cases = [(generate.Model, os.path.join(d, "missing.bin"), FileNotFoundError,
                      errno.ENOENT),
                     (generate.Model, d, IsADirectoryError, errno.EISDIR),
                     (lambda p: generate.Tokenizer(p, 300), os.path.join(d, "no", "t.bin"),
                      FileNotFoundError, errno.ENOENT),
                     (lambda p: generate.Tokenizer(p, 300), os.path.join(d, "model.bin", "t"),
                      NotADirectoryError, errno.ENOTDIR)]
            if len(sys.argv) > 3:
                cases = [(generate.Model, sys.argv[3], PermissionError, errno.EACCES)]
            for make, path, cls, err in cases:
                try:
                    make(path)
                except cls as exc:
                    assert (exc.errno, exc.filename) == (err, path), (exc.errno, exc.filename)
                    print(type(exc).__name__)
                else:
                    raise AssertionError(f"{path}: no {cls.__name__}")
        """)
        d = self.tmp.name
        r = subprocess.run([sys.executable, "-c", code, GENERATE, d], capture_output=True,
                           text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stdout.split(), ["FileNotFoundError", "IsADirectoryError",
                                            "FileNotFoundError", "NotADirectoryError"])
        secret = os.path.join(d, "secret.bin")
        shutil.copy(self.model, secret)
        os.chmod(secret, 0o600)
        kw = {}
        if os.geteuid() == 0:
            os.chmod(d, 0o755)
            kw["preexec_fn"] = lambda: (os.setgid(65534), os.setuid(65534))
        else:
            os.chmod(secret, 0)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
        r = subprocess.run([sys.executable, "-c", code, GENERATE, d, secret],
                           capture_output=True, text=True, env=env, **kw)
        self.assertEqual((r.returncode, r.stdout.split()), (0, ["PermissionError"]),
                         r.stderr)
        got = py_run("--model", secret, **({"preexec_fn": kw["preexec_fn"]} if kw else {}))
        self.assertEqual(got.returncode, 1, got.stderr)
        self.assertEqual(got.stderr.decode(),
                         f"generate.py: cannot open model '{secret}': Permission denied\n")

    def test_steps_beyond_seq_len(self):
        want = c_run("--model", self.model, "--tokenizer", self.tok, "-t", "0", "-n", "1000")
        got = py_run("--model", self.model, "--tokenizer", self.tok, "-t", "0", "-n", "1000")
        self.assertEqual(got.returncode, 0, got.stderr)
        self.assertEqual(body(got.stderr, "generate.py"), body(want.stderr, "pagedkv generate"))
        self.assertEqual(got.stdout, want.stdout)

    def test_head_closes_the_pipe(self):
        for args in (["-t", "0"], ["-t", "1", "-s", "5"]):
            with self.subTest(args=args):
                p = subprocess.Popen([sys.executable, GENERATE, "--model", self.model,
                                      "--tokenizer", self.tok, "-n", "64", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                p.stdout.read(3)
                p.stdout.close()                         # what `| head -c 3` does
                err = p.stderr.read()
                p.stderr.close()
                rc = p.wait(timeout=120)
                self.assertEqual(err, b"")
                self.assertEqual(rc, -signal.SIGPIPE)     # as the C tool: killed quietly


if __name__ == "__main__":
    pkvtest.run()
