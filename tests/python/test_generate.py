"""tools/python/generate.py, the numpy transformer with pagedkv as its attention layer,
prints exactly `pagedkv generate --model stories260K ... -t 0`'s text (greedy, f32 KV),
for several prompts and lengths, and the same with an f16 cache and other page sizes;
and the same sampled text at -t > 0 (the C tool's sampler and coins)."""
import os
import subprocess
import sys
import unittest

import pkvtest  # noqa: F401  (SKIP without numpy)

SRC = os.environ.get("PKV_SRCDIR", os.path.join(os.path.dirname(__file__), "..", ".."))
SHARED = os.environ.get("PKV_SHARED_DIR", os.path.join(SRC, "..", "shared"))
TOOL = os.environ.get("PKV_TOOL", os.path.join(SRC, "build", "tools", "pagedkv"))
MODEL = os.path.join(SHARED, "models", "stories260K.bin")
TOKENIZER = os.path.join(SHARED, "models", "tok512.bin")
GENERATE = os.path.join(SRC, "tools", "python", "generate.py")

if not (os.path.exists(MODEL) and os.path.exists(TOKENIZER)):
    print(f"SKIP: {MODEL} or {TOKENIZER} is missing")
    sys.exit(77)


def c_text(*args):
    return subprocess.run([TOOL, "generate", "--model", MODEL, "--tokenizer", TOKENIZER,
                           "-t", "0", "--threads", "1", *args],
                          capture_output=True, check=True).stdout


def py_text(*args):
    return subprocess.run([sys.executable, GENERATE, "--model", MODEL, "--tokenizer",
                           TOKENIZER, "-t", "0", *args], capture_output=True,
                          check=True).stdout


class Generate(unittest.TestCase):
    def test_same_text_as_pagedkv_generate(self):
        cases = [["-n", "256", "-i", "Once upon a time"], ["-n", "120"],
                 ["-n", "200", "-i", "The little dog"], ["-n", "40", "-i", "Lily and Ben"],
                 ["-n", "64", "-i", "Once upon a time", "--dtype", "f16",
                  "--block-tokens", "4"]]
        for args in cases[:3] if pkvtest.QUICK else cases:
            with self.subTest(args=args):
                want = c_text(*args)
                got = py_text(*args)
                self.assertGreater(len(want), 10)
                self.assertEqual(got, want)

    def test_same_sampled_text(self):
        # the C tool's sampler and random stream: the same text at -t > 0 too
        for args in (["-n", "120", "-i", "Once upon a time", "-t", "1", "-s", "42"],
                     ["-n", "160", "-t", "0.8", "-p", "0.95", "-s", "7"]):
            with self.subTest(args=args):
                want = c_text(*args)
                got = py_text(*args)
                self.assertEqual(got, want)

    def test_known_anchor(self):
        # models/README.md: greedy "Once upon a time" continues ", there was a little
        # girl named Lily."
        got = py_text("-n", "20", "-i", "Once upon a time")
        self.assertTrue(got.startswith(b"Once upon a time, there was a little girl named Lily."),
                        got)


if __name__ == "__main__":
    pkvtest.run()
