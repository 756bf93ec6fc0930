"""pagedkv_build - the PEP 517 build backend of the Python package (pyproject.toml).

    pip install ./tools/python              # a wheel built here, installed by pip
    pip install -e ./tools/python           # editable: imports this source tree

The package is pure Python, so its wheel is a zip of pagedkv/*.py and the metadata
files; this backend writes it with the standard library alone. It needs nothing to be
downloaded (pyproject.toml's build-system requires nothing), so pip's isolated build
works offline, where one that requires setuptools would have to fetch it first.

What the wheel carries beyond the sources: pagedkv/_install.py with LIBDIR, the
directory of the installed libpagedkv.so.3 when it is known at build time - from
`pip install --config-settings libdir=DIR`, else $PAGEDKV_LIBDIR, else
`pkg-config --variable=libdir pagedkv` (meson install's pagedkv.pc) - so that the
installed package finds the library without ldconfig or LD_LIBRARY_PATH. The
version is the C project's (meson.build's project() version, or PKG-INFO's in an
sdist): `pip show pagedkv` and pagedkv.version() name the same release.
"""
import base64
import hashlib
import io
import os
import re
import subprocess
import tarfile
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
NAME = "pagedkv"
TAG = "py3-none-any"
# Files of the package directory that are not installed: meson's template.
_SKIP = {"_install.py.in", "_install.py"}


# ---- metadata ------------------------------------------------------------------------
def _project():
    """pyproject.toml's [project] table."""
    with open(os.path.join(HERE, "pyproject.toml"), "rb") as f:
        data = f.read()
    try:
        import tomllib                                      # Python 3.11
        return tomllib.loads(data.decode())["project"]
    except ImportError:
        return _parse_project(data.decode())


def _parse_project(text):
    """The [project] table of this repository's pyproject.toml, for Pythons without
    tomllib: `key = "string"` and `key = ["string", ...]` lines only (all it uses)."""
    out, section = {}, None
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line.strip("[]").strip()
            continue
        m = re.match(r'([\w-]+)\s*=\s*(.+)$', line)
        if section == "project" and m:
            key, val = m.groups()
            if val.startswith("["):
                out[key] = re.findall(r'"([^"]*)"', val)
            else:
                out[key] = val.strip('"')
    return out


def _version():
    meson = os.path.join(HERE, "..", "..", "meson.build")
    if os.path.exists(meson):
        with open(meson) as f:
            m = re.search(r"project\([^)]*?version\s*:\s*'([^']+)'", f.read(), re.S)
        if m:
            return m.group(1)
    pkg_info = os.path.join(HERE, "PKG-INFO")
    if os.path.exists(pkg_info):
        with open(pkg_info) as f:
            m = re.search(r"^Version: (\S+)$", f.read(), re.M)
        if m:
            return m.group(1)
    raise RuntimeError("pagedkv_build: no version: neither ../../meson.build nor PKG-INFO")


def _metadata():
    p = _project()
    lines = ["Metadata-Version: 2.1", f"Name: {NAME}", f"Version: {_version()}"]
    if p.get("description"):
        lines.append(f"Summary: {p['description']}")
    if p.get("requires-python"):
        lines.append(f"Requires-Python: {p['requires-python']}")
    lic = p.get("license")
    if isinstance(lic, dict):
        lic = lic.get("text")
    if lic:
        lines.append(f"License: {lic}")
    for dep in p.get("dependencies", []):
        lines.append(f"Requires-Dist: {dep}")
    return "\n".join(lines) + "\n"


def _dist_info():
    return f"{NAME}-{_version()}.dist-info"


# ---- the library's directory, recorded in _install.py ------------------------------
def _libdir(config_settings):
    d = (config_settings or {}).get("libdir") or os.environ.get("PAGEDKV_LIBDIR")
    if d:
        return d
    try:
        r = subprocess.run(["pkg-config", "--variable=libdir", "pagedkv"],
                           capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    return r.stdout.strip() if r.returncode == 0 else ""


def _install_py(config_settings):
    return ("# Written by pagedkv_build (pip install) at build time: the directory of the\n"
            "# installed libpagedkv (pkg-config's libdir of pagedkv), '' if unknown.\n"
            f"LIBDIR = {_libdir(config_settings)!r}\n")


# ---- wheels --------------------------------------------------------------------------
def _sources():
    pkg = os.path.join(HERE, NAME)
    return sorted(f for f in os.listdir(pkg) if f.endswith(".py") and f not in _SKIP)


class _Wheel:
    def __init__(self, path):
        self.zip = zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED)
        self.record = []

    def add(self, name, data):
        if isinstance(data, str):
            data = data.encode()
        info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
        info.external_attr = 0o644 << 16
        info.compress_type = zipfile.ZIP_DEFLATED
        self.zip.writestr(info, data)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
        self.record.append(f"{name},sha256={digest.decode()},{len(data)}")

    def close(self):
        di = _dist_info()
        self.add(f"{di}/METADATA", _metadata())
        self.add(f"{di}/WHEEL", "Wheel-Version: 1.0\nGenerator: pagedkv_build\n"
                                "Root-Is-Purelib: true\nTag: py3-none-any\n")
        self.add(f"{di}/top_level.txt", NAME + "\n")
        record = "\n".join(self.record + [f"{di}/RECORD,,"]) + "\n"
        info = zipfile.ZipInfo(f"{di}/RECORD", date_time=(1980, 1, 1, 0, 0, 0))
        info.external_attr = 0o644 << 16
        self.zip.writestr(info, record)
        self.zip.close()


def _wheel_name():
    return f"{NAME}-{_version()}-{TAG}.whl"


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    name = _wheel_name()
    w = _Wheel(os.path.join(wheel_directory, name))
    for f in _sources():
        with open(os.path.join(HERE, NAME, f), "rb") as src:
            w.add(f"{NAME}/{f}", src.read())
    w.add(f"{NAME}/_install.py", _install_py(config_settings))
    w.close()
    return name


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    """A wheel whose .pth puts this source directory on sys.path (PEP 660)."""
    name = _wheel_name()
    w = _Wheel(os.path.join(wheel_directory, name))
    w.add(f"_{NAME}_editable.pth", HERE + "\n")
    w.close()
    return name


def _requires(config_settings=None):
    return []


get_requires_for_build_wheel = get_requires_for_build_sdist = _requires
get_requires_for_build_editable = _requires


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    di = os.path.join(metadata_directory, _dist_info())
    os.makedirs(di, exist_ok=True)
    with open(os.path.join(di, "METADATA"), "w") as f:
        f.write(_metadata())
    return _dist_info()


prepare_metadata_for_build_editable = prepare_metadata_for_build_wheel


# ---- sdists --------------------------------------------------------------------------
def build_sdist(sdist_directory, config_settings=None):
    base = f"{NAME}-{_version()}"
    name = base + ".tar.gz"
    files = ["pyproject.toml", "pagedkv_build.py", "generate.py"] + \
            [f"{NAME}/{f}" for f in _sources()]
    with tarfile.open(os.path.join(sdist_directory, name), "w:gz",
                      format=tarfile.PAX_FORMAT) as tar:
        for f in files:
            tar.add(os.path.join(HERE, f), arcname=f"{base}/{f}")
        pkg_info = _metadata().encode()
        ti = tarfile.TarInfo(f"{base}/PKG-INFO")
        ti.size, ti.mode = len(pkg_info), 0o644
        tar.addfile(ti, io.BytesIO(pkg_info))
    return name
