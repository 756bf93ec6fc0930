"""Installing the package the ways a Python user does:

- `pip install ./tools/python` into a virtual environment, offline (pyproject.toml and
  its backend need nothing downloaded): `pip show` knows it with the C project's
  version, it imports from the venv (not the source tree), finds the library through
  $PAGEDKV_LIBRARY or the library directory recorded at install, says where it looked
  when nothing has it, and `pip uninstall` removes every file; `pip install -e` too.
- `meson install`: every module of the package is in the install plan, in a site
  directory that the interpreter meson chose searches (tools/python/site_dir.py), with
  _install.py's soname the library's.
- The soname the ctypes declarations are written for is the built library's
  DT_SONAME and meson.build's soversion.

SKIP (77) where the interpreter has no venv or ensurepip (Debian: python3-venv)."""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest

import pkvtest  # noqa: F401  (SKIP without numpy)

from test_import import elf_dynamic

LIB = os.environ.get("PAGEDKV_LIBRARY", "")
SRC = os.environ.get("PKV_SRCDIR", os.path.join(os.path.dirname(__file__), "..", ".."))
BUILD = os.environ.get("PKV_BUILDDIR", "")
PKG_SRC = os.path.join(SRC, "tools", "python")

try:
    import ensurepip  # noqa: F401
    import venv  # noqa: F401
except ImportError:
    print(f"SKIP: {sys.executable} has no venv/ensurepip (Debian: apt-get install "
          "python3-venv)")
    sys.exit(77)


def meson_version():
    with open(os.path.join(SRC, "meson.build")) as f:
        text = f.read()
    version = re.search(r"project\([^)]*?version\s*:\s*'([^']+)'", text, re.S).group(1)
    soversion = re.search(r"^soversion\s*=\s*'(\d+)'", text, re.M).group(1)
    return version, soversion


def clean_env(**extra):
    """The environment of a user's shell: no PYTHONPATH pointing at the source tree,
    no PAGEDKV_LIBRARY unless given, pip offline."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PAGEDKV_LIBRARY", "PIP_INDEX_URL", "VIRTUAL_ENV")}
    env.update(PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_CACHE_DIR="1",
               PYTHONDONTWRITEBYTECODE="1")
    env.update(extra)
    return env


def run(args, **kw):
    env = kw.pop("env", None) or clean_env()
    return subprocess.run(args, capture_output=True, text=True, env=env, timeout=300, **kw)


class Pip(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="pkv-venv-")
        cls.venv = os.path.join(cls.tmp, "venv")
        r = run([sys.executable, "-m", "venv", "--system-site-packages", cls.venv])
        if r.returncode != 0:
            raise unittest.SkipTest(f"python3 -m venv failed: {r.stderr.strip()[-300:]}")
        cls.py = os.path.join(cls.venv, "bin", "python")
        cls.pip = [cls.py, "-m", "pip"]
        # a copy of the package's source directory beside a copy of meson.build, so
        # that nothing is written into the source tree (pip builds in place)
        cls.src = os.path.join(cls.tmp, "src")
        shutil.copytree(PKG_SRC, os.path.join(cls.src, "tools", "python"),
                        ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy(os.path.join(SRC, "meson.build"), cls.src)
        cls.pkg = os.path.join(cls.src, "tools", "python")

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def install(self, *args, env=None):
        r = run(self.pip + ["install", *args], env=env or clean_env(PAGEDKV_LIBDIR=""))
        self.assertEqual(r.returncode, 0, r.stdout[-2000:] + r.stderr[-3000:])
        return r

    def uninstall(self):
        r = run(self.pip + ["uninstall", "-y", "pagedkv"])
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertNotEqual(run(self.pip + ["show", "pagedkv"]).returncode, 0)
        site = run([self.py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"])
        left = [f for f in os.listdir(site.stdout.strip()) if "pagedkv" in f.lower()]
        self.assertEqual(left, [], "pip uninstall left files behind")

    def probe(self, env, code="import pagedkv; print(pagedkv.__file__); "
                              "print(pagedkv.library_path); print(pagedkv.version())"):
        return run([self.py, "-c", code], env=env, cwd=self.tmp)

    def test_pip_install_show_import_uninstall(self):
        version, soversion = meson_version()
        # no libdir recorded: PAGEDKV_LIBDIR empty and no pagedkv.pc on pkg-config's path
        self.install(self.pkg, env=clean_env(PAGEDKV_LIBDIR="", PKG_CONFIG_PATH="",
                                             PKG_CONFIG_LIBDIR="/nonexistent"))
        show = run(self.pip + ["show", "pagedkv"])
        self.assertEqual(show.returncode, 0, show.stderr)
        fields = dict(line.split(": ", 1) for line in show.stdout.splitlines() if ": " in line)
        self.assertEqual(fields["Name"], "pagedkv")
        self.assertEqual(fields["Version"], version)
        self.assertEqual(fields["Requires"], "numpy")
        # imports from the venv, with the library named by PAGEDKV_LIBRARY
        r = self.probe(clean_env(PAGEDKV_LIBRARY=LIB))
        self.assertEqual(r.returncode, 0, r.stderr)
        where, path, v = r.stdout.split()
        self.assertTrue(where.startswith(os.path.realpath(self.venv)) or
                        where.startswith(self.venv), where)
        self.assertEqual((path, v), (LIB, version))
        # nothing has the library: one error naming the three places
        r = self.probe(clean_env(LD_LIBRARY_PATH=""))
        if r.returncode == 0:
            self.skipTest(f"a libpagedkv.so.{soversion} is installed on this machine: "
                          f"{r.stdout.split()[1]}")
        self.assertIn("ImportError", r.stderr)
        for place in ("$PAGEDKV_LIBRARY: not set", "the installed prefix",
                      "the dynamic loader's path", f"libpagedkv.so.{soversion}"):
            self.assertIn(place, r.stderr)
        # the loader's path: LD_LIBRARY_PATH
        r = self.probe(clean_env(LD_LIBRARY_PATH=os.path.dirname(LIB)))
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stdout.split()[1], f"libpagedkv.so.{soversion}")
        self.uninstall()

    def test_recorded_libdir(self):
        # what meson install's pagedkv.pc gives pip at build time, here by the setting
        libdir = os.path.dirname(LIB)
        self.install("--config-settings", f"libdir={libdir}", self.pkg)
        r = self.probe(clean_env())
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stdout.split()[1],
                         os.path.join(libdir, f"libpagedkv.so.{meson_version()[1]}"))
        self.uninstall()
        # and from pkg-config, as after meson install
        pc = os.path.join(self.tmp, "pc")
        os.makedirs(pc, exist_ok=True)
        with open(os.path.join(pc, "pagedkv.pc"), "w") as f:
            f.write(f"libdir={libdir}\nName: pagedkv\nDescription: x\nVersion: 0\n"
                    "Libs: -L${libdir} -lpagedkv\n")
        if shutil.which("pkg-config"):
            self.install(self.pkg, env=clean_env(PKG_CONFIG_PATH=pc))
            r = self.probe(clean_env())
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertTrue(r.stdout.split()[1].startswith(libdir + "/"), r.stdout)
            self.uninstall()

    def test_editable(self):
        self.install("-e", self.pkg)
        r = self.probe(clean_env(PAGEDKV_LIBRARY=LIB))
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stdout.split()[0],
                         os.path.join(self.pkg, "pagedkv", "__init__.py"))
        self.uninstall()

    def test_sdist_and_wheel_contents(self):
        out = os.path.join(self.tmp, "dist")
        os.makedirs(out, exist_ok=True)
        code = ("import sys, pagedkv_build as b; "
                "print(b.build_sdist(sys.argv[1])); print(b.build_wheel(sys.argv[1]))")
        r = run([sys.executable, "-c", code, out], cwd=self.pkg,
                env=clean_env(PYTHONPATH=self.pkg, PAGEDKV_LIBDIR="/x"))
        self.assertEqual(r.returncode, 0, r.stderr)
        sdist, wheel = r.stdout.split()
        import tarfile
        import zipfile
        version = meson_version()[0]
        with zipfile.ZipFile(os.path.join(out, wheel)) as z:
            names = set(z.namelist())
            modules = {f"pagedkv/{f}" for f in os.listdir(os.path.join(PKG_SRC, "pagedkv"))
                       if f.endswith(".py")}
            self.assertLessEqual(modules | {"pagedkv/_install.py"}, names)
            self.assertIn("LIBDIR = '/x'", z.read("pagedkv/_install.py").decode())
            record = z.read(f"pagedkv-{version}.dist-info/RECORD").decode().split()
            self.assertEqual({line.split(",")[0] for line in record}, names)
        # the sdist builds the same wheel without the repository around it
        unpack = os.path.join(self.tmp, "unpacked")
        with tarfile.open(os.path.join(out, sdist)) as t:
            t.extractall(unpack)
        r = run([sys.executable, "-c", "import sys, pagedkv_build as b; "
                 "print(b.build_wheel(sys.argv[1]))", out],
                cwd=os.path.join(unpack, f"pagedkv-{version}"),
                env=clean_env(PYTHONPATH=os.path.join(unpack, f"pagedkv-{version}")))
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stdout.strip(), wheel)


class Meson(unittest.TestCase):
    def test_soname(self):
        from pagedkv import _lib
        version, soversion = meson_version()
        self.assertEqual(_lib.ABI_SONAME, f"libpagedkv.so.{soversion}")
        self.assertEqual(elf_dynamic(LIB, 14), [_lib.ABI_SONAME.encode()])   # DT_SONAME
        if BUILD:
            with open(os.path.join(BUILD, "tools", "python", "_install.py")) as f:
                self.assertIn(f'SONAME = "{_lib.ABI_SONAME}"', f.read())

    @unittest.skipUnless(BUILD, "PKV_BUILDDIR is not set")
    def test_install_plan(self):
        with open(os.path.join(BUILD, "meson-info", "intro-installed.json")) as f:
            installed = json.load(f)
        with open(os.path.join(BUILD, "meson-info", "intro-buildoptions.json")) as f:
            opts = {o["name"]: o["value"] for o in json.load(f)}
        pkg = os.path.realpath(os.path.join(PKG_SRC, "pagedkv"))
        dests = {os.path.realpath(src): dst for src, dst in installed.items()}
        modules = [f for f in os.listdir(pkg) if f.endswith(".py")]
        dirs = {os.path.dirname(dests.get(os.path.join(pkg, m), "")) for m in modules}
        self.assertNotIn("", dirs, "a module of the package is not installed")
        built = os.path.realpath(os.path.join(BUILD, "tools", "python", "_install.py"))
        dirs.add(os.path.dirname(dests[built]))
        self.assertEqual(len(dirs), 1, dirs)
        target = dirs.pop()
        self.assertEqual(os.path.basename(target), "pagedkv")
        site = os.path.dirname(target)
        # meson ran this interpreter (tests/meson.build): its sys.path has the site
        # directory whenever one under the prefix exists
        sys.path_importer_cache.clear()
        prefix = opts["prefix"]
        if opts.get("python.purelibdir"):
            self.assertEqual(site, opts["python.purelibdir"])
        else:
            searched = [p for p in sys.path if p and os.path.commonpath([p, prefix]) == prefix
                        and os.path.basename(p) in ("site-packages", "dist-packages")]
            if searched:
                self.assertIn(site, sys.path)
            else:
                py = f"python{sys.version_info[0]}.{sys.version_info[1]}"
                self.assertEqual(site, os.path.join(prefix, "lib", py, "site-packages"))

    def test_site_dir_choices(self):
        sys.path.insert(0, PKG_SRC)
        try:
            import site_dir
        finally:
            sys.path.remove(PKG_SRC)
        py = f"python{sys.version_info[0]}.{sys.version_info[1]}"
        for prefix in {"/usr/local", "/usr", sys.prefix}:
            d, ok = site_dir.site_dir(prefix)
            if ok:
                self.assertIn(d, sys.path)
                self.assertEqual(os.path.commonpath([d, prefix]), prefix)
        d, ok = site_dir.site_dir("/nonexistent/prefix")
        self.assertEqual((d, ok), (f"/nonexistent/prefix/lib/{py}/site-packages", False))
        # a virtual environment's prefix is searched by its own interpreter
        with tempfile.TemporaryDirectory() as tmp:
            r = run([sys.executable, "-m", "venv", "--without-pip", tmp])
            self.assertEqual(r.returncode, 0, r.stderr)
            r = run([os.path.join(tmp, "bin", "python"), os.path.join(PKG_SRC, "site_dir.py"),
                     tmp])
            self.assertEqual(r.stdout.split(),
                             [os.path.join(tmp, "lib", py, "site-packages"), "searched"])


if __name__ == "__main__":
    pkvtest.run()
