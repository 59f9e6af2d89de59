"""Tests of tools/stage_wheelhouse.py and tools/unstage_wheelhouse.sh, without network.

The resolver runs over a fake in-memory index; packing, splitting and unstaging run on small fake
wheels with 1 KiB parts.
"""
import hashlib
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SCRIPT = os.path.join(ROOT, "tools", "stage_wheelhouse.py")
UNSTAGE = os.path.join(ROOT, "tools", "unstage_wheelhouse.sh")

_spec = importlib.util.spec_from_file_location("stage_wheelhouse", SCRIPT)
sw = importlib.util.module_from_spec(_spec)
sys.modules["stage_wheelhouse"] = sw  # dataclasses look the module up by name
_spec.loader.exec_module(sw)

ENV312 = sw.target_environment("3.12", "x86_64")
HAVE_BASH = shutil.which("bash") is not None and shutil.which("tar") is not None


def _packaging_markers():
    try:
        from packaging.markers import Marker
        return Marker
    except ImportError:
        try:
            from pip._vendor.packaging.markers import Marker
            return Marker
        except ImportError:
            return None


# ------------------------------------------------------------------------------------------------
# markers, requirements, names
# ------------------------------------------------------------------------------------------------

MARKER_CASES = [
    ('python_version > "3.11"', True),
    ('python_version < "3.10"', False),
    ('python_version >= "3.12" and python_version < "3.13"', True),
    ('python_full_version >= "3.12.0"', True),
    ('python_version == "3.1"', False),
    ('python_version ~= "3.10"', True),
    ('python_version == "3.*"', True),
    ('python_version != "3.12.*"', False),
    ('platform_machine == "x86_64" or platform_machine == "aarch64"', True),
    ('platform_machine == "arm64" or platform_machine == "aarch64"', False),
    ('sys_platform == "linux"', True),
    ('sys_platform == "win32" or sys_platform == "darwin"', False),
    ('platform_system == "Linux" and (python_version < "3.9" or os_name == "posix")', True),
    ("platform_system != 'Windows'", True),
    ('implementation_name == "cpython" and platform_python_implementation == "CPython"', True),
    ('"linux" in sys_platform', True),
    ('"win" not in sys_platform', True),
    ('extra == "audio"', False),
    ('python_version >= "3.8" and extra == "audio"', False),
]


@pytest.mark.parametrize("marker,expected", MARKER_CASES)
def test_marker_evaluation(marker, expected):
    assert sw.evaluate_marker(marker, ENV312) is expected
    Marker = _packaging_markers()
    if Marker is not None:  # agree with the reference implementation
        ref = dict(ENV312)
        assert Marker(marker).evaluate(ref) is expected


def test_marker_extras_and_legacy_names():
    env = dict(ENV312, extra="audio")
    assert sw.evaluate_marker('extra == "audio"', env)
    assert sw.evaluate_marker('extra == "Audio"', env)  # names compare normalized
    assert not sw.evaluate_marker('extra == "video"', env)
    assert sw.evaluate_marker("os.name == 'posix' and sys.platform == 'linux'", ENV312)
    req = sw.parse_requirement('soundfile; extra == "audio"')
    assert not sw.marker_applies(req, ENV312)
    assert sw.marker_applies(req, ENV312, ["audio"])
    with pytest.raises(sw.MarkerError):
        sw.evaluate_marker('python_version >', ENV312)
    with pytest.raises(sw.MarkerError):
        sw.evaluate_marker('no_such_var == "1"', ENV312)


def test_marker_other_targets():
    env39 = sw.target_environment("3.9.18", "aarch64")
    assert env39["python_full_version"] == "3.9.18"
    assert sw.evaluate_marker('python_version < "3.10"', env39)
    assert sw.evaluate_marker('platform_machine == "aarch64"', env39)
    assert sw.machine_from_platform("manylinux_2_28_aarch64") == "aarch64"


def test_parse_requirement_forms():
    r = sw.parse_requirement("fastapi[standard]<0.137.0,>=0.133.0")
    assert (r.key, r.extras) == ("fastapi", {"standard"})
    assert sorted(r.specs) == ["<0.137.0", ">=0.133.0"]
    r = sw.parse_requirement('llguidance<1.8.0,>=1.7.0; platform_machine == "x86_64"')
    assert r.marker == 'platform_machine == "x86_64"' and r.key == "llguidance"
    r = sw.parse_requirement("Foo_Bar.baz (>=1.0, <2)")
    assert r.key == "foo-bar-baz" and sorted(r.specs) == ["<2", ">=1.0"]
    r = sw.parse_requirement("mistral_common[image, audio]>=1.11.5")
    assert r.extras == {"image", "audio"}
    r = sw.parse_requirement(
        "pkg @ https://example.invalid/pkg-1.0-py3-none-any.whl ; python_version > '3'")
    assert r.url.endswith(".whl") and r.marker
    assert sw.normalize("PyNvVideoCodec") == "pynvvideocodec"
    assert sw.normalize("typing_extensions") == "typing-extensions"


def test_version_key_ordering():
    order = ["1.0.dev1", "1.0a1", "1.0b2", "1.0rc1", "1.0", "1.0.post1", "1.1", "2!0.1"]
    keys = [sw.version_key(v) for v in order]
    assert keys == sorted(keys)
    assert sw.version_key("3.12") == sw.version_key("3.12.0")
    assert sw.version_key("not a version") is None


def test_parse_size_and_platforms():
    assert sw.parse_size("64M") == 64 * 1024 * 1024
    assert sw.parse_size("1K") == 1024 and sw.parse_size("1KiB") == 1024
    assert sw.parse_size("1048576") == 1048576
    tags = sw.expand_platforms(["manylinux_2_28_x86_64"])
    assert tags[0] == "manylinux_2_28_x86_64"
    for t in ("manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64"):
        assert t in tags
    assert "manylinux_2_31_x86_64" not in tags
    assert sw.expand_platforms(["linux_x86_64"]) == ["linux_x86_64"]


# ------------------------------------------------------------------------------------------------
# have-list and excludes
# ------------------------------------------------------------------------------------------------

def test_have_list_formats(tmp_path):
    freeze = tmp_path / "freeze.txt"
    freeze.write_text("torch==2.11.0+cu130\nTyping_Extensions==4.15.0\nfoo @ file:///x\n# c\n")
    pip_list = tmp_path / "list.txt"
    pip_list.write_text("Package    Version\n---------- -------\n"
                        "numpy      2.5.2\ntriton     3.6.0\n")
    as_json = tmp_path / "list.json"
    as_json.write_text(json.dumps([{"name": "safetensors", "version": "0.8.0"}]))
    kinds_like = tmp_path / "names.txt"
    kinds_like.write_text("absl-py, accelerate, nvidia-cublas, nvidia-nccl-cu13, zipp.\n")
    have = sw.load_have([str(freeze), str(pip_list), str(as_json), str(kinds_like),
                         "transformers==5.17.0,pyyaml"])
    assert have["torch"] == "2.11.0+cu130"
    assert have["typing-extensions"] == "4.15.0"
    assert have["foo"] is None
    assert have["numpy"] == "2.5.2" and have["triton"] == "3.6.0"
    assert have["safetensors"] == "0.8.0"
    assert have["transformers"] == "5.17.0" and "pyyaml" in have
    assert {"absl-py", "accelerate", "nvidia-cublas", "nvidia-nccl-cu13", "zipp"} <= set(have)
    assert "package" not in have and "version" not in have


def _info(name, version, requires=()):
    return sw.WheelInfo(sw.normalize(name), version, "%s-%s-py3-none-any.whl" % (name, version),
                        list(requires))


def test_walk_skips_have_list_and_excludes():
    roots = [sw.parse_requirement("app==1.0")]
    meta = {
        "app": _info("app", "1.0", [
            "torch==2.11.0", "lib-b>=1", "lib-c[fast]", "videocodec==2.0",
            'old-backport; python_version < "3.10"', 'winonly; sys_platform == "win32"',
            'bench-tool; extra == "bench"']),
        "lib-b": _info("lib-b", "1.2", ["numpy>=1.25", "nvidia-cuda-nvrtc", "lib-d"]),
        "lib-c": _info("lib-c", "3.0", ['lib-e; extra == "fast"', 'lib-f; extra == "slow"']),
        "lib-d": _info("lib-d", "0.1", ["torch", "lib-b"]),  # a cycle back to lib-b
        "lib-e": _info("lib-e", "1.0", []),
    }
    have = {"torch": "2.11.0", "numpy": "2.5.2", "nvidia-cuda-nvrtc": None}
    excludes = sw.parse_excludes(["videocodec=video only", "nvidia-*"])
    g = sw.walk(roots, meta, ENV312, have, excludes)
    assert set(g.needed) == {"app", "lib-b", "lib-c", "lib-d", "lib-e"}
    assert set(g.present) == {"torch", "numpy"}  # nvrtc hit the nvidia-* exclude first
    assert set(g.dropped) == {"videocodec", "nvidia-cuda-nvrtc"}
    assert g.present["torch"].required_by == {"app", "lib-d"}
    assert g.present["numpy"].specs == {">=1.25"}
    assert g.needed["lib-c"].extras == {"fast"}
    assert not g.unresolved
    present, dropped = sw.graph_records(g, have)
    rec = {p["name"]: p for p in present}
    assert rec["torch"]["status"] in ("ok", "unverified")
    assert {d["name"] for d in dropped} == {"videocodec", "nvidia-cuda-nvrtc"}
    # extras requested at the root are followed
    g2 = sw.walk([sw.parse_requirement("app[bench]==1.0")], meta, ENV312, have, excludes)
    assert "bench-tool" in g2.unresolved
    # a have-listed name is never reported unresolved (it is never fetched)
    g3 = sw.walk(roots, {}, ENV312, have, excludes)
    assert g3.unresolved == {"app"}


# ------------------------------------------------------------------------------------------------
# resolution over a fake index (backtracking, have pins); needs pip's vendored resolvelib
# ------------------------------------------------------------------------------------------------

class FakeIndex:
    """candidates(name) -> [(Version, file)], metadata(cand) -> Requires-Dist lines."""

    def __init__(self, projects):
        from stage_wheelhouse import _import_packaging
        self.Version = _import_packaging()[1]
        self.projects = projects  # name -> {version: [requires]}
        self.asked = []

    def prefetch(self, name):
        pass

    def prefetch_metadata(self, cand):
        pass

    def candidates(self, name):
        self.asked.append(name)
        if name not in self.projects:
            raise RuntimeError("%s is not on the fake index" % name)
        return sorted(((self.Version(v), {"filename": "%s-%s-py3-none-any.whl" % (name, v),
                                          "url": "x://%s/%s" % (name, v), "size": 100})
                       for v in self.projects[name]), key=lambda x: x[0], reverse=True)

    def metadata(self, cand):
        return list(self.projects[cand.name][str(cand.version)])


needs_resolvelib = pytest.mark.skipif(
    sw._import_resolvelib() is None or sw._import_packaging() is None,
    reason="no resolvelib/packaging (pip vendors both)")


@needs_resolvelib
def test_resolve_backtracks_to_compatible_versions():
    idx = FakeIndex({
        "app": {"1.0": ["quack>=0.4", "cutlass==4.6.0", "torch==2.11.0"]},
        "quack": {"0.9": ["cutlass>=4.8"], "0.8": ["cutlass>=4.7"], "0.6": ["cutlass>=4.5"],
                  "0.3": []},
        "cutlass": {"4.8.0": [], "4.7.0": [], "4.6.0": ['libs-cu13==4.6.0; extra == "cu13"']},
    })
    target = sw.Target("3.12", ["manylinux_2_28_x86_64"])
    g, meta = sw.resolve([sw.parse_requirement("app==1.0")], target, {"torch": None}, [], idx,
                         log=lambda s: None)
    assert {n: m.version for n, m in meta.items()} == {"app": "1.0", "quack": "0.6",
                                                       "cutlass": "4.6.0"}
    assert "torch" not in idx.asked  # the target has it: never looked up, never downloaded
    assert set(g.present) == {"torch"}


@needs_resolvelib
def test_resolve_prefers_versions_that_fit_the_targets_known_versions():
    projects = {
        "app": {"1.0": ["mc>=1.0"]},
        "mc": {"2.0": ["numpy<2.4"], "1.5": ["numpy<2.4"], "1.0": ["numpy>=1.25"]},
    }
    target = sw.Target("3.12", ["manylinux_2_28_x86_64"])
    g, meta = sw.resolve([sw.parse_requirement("app")], target, {"numpy": "2.5.2"}, [],
                         FakeIndex(projects), log=lambda s: None)
    assert meta["mc"].version == "1.0"
    present, _ = sw.graph_records(g, {"numpy": "2.5.2"})
    assert present[0]["status"] == "ok"
    # when no version fits, it resolves without the pin and reports the conflict
    projects["mc"].pop("1.0")
    logs = []
    g, meta = sw.resolve([sw.parse_requirement("app")], target, {"numpy": "2.5.2"}, [],
                         FakeIndex(projects), log=logs.append)
    assert meta["mc"].version == "2.0" and logs
    present, _ = sw.graph_records(g, {"numpy": "2.5.2"})
    assert present[0]["status"] == "conflict" and present[0]["unmet"] == {"mc": "<2.4"}


@needs_resolvelib
def test_resolve_follows_extras_and_reports_impossible():
    idx = FakeIndex({
        "app": {"1.0": ["lib[cu13]==2.0", 'skipme; python_version < "3.10"']},
        "lib": {"2.0": ['libs-cu13==2.0; extra == "cu13"', "libs-base==2.0"]},
        "libs-cu13": {"2.0": []},
        "libs-base": {"2.0": []},
    })
    target = sw.Target("3.12", ["manylinux_2_28_x86_64"])
    g, meta = sw.resolve([sw.parse_requirement("app")], target, {}, [], idx, log=lambda s: None)
    assert set(meta) == {"app", "lib", "libs-cu13", "libs-base"}
    bad = FakeIndex({"app": {"1.0": ["lib==1.0", "other"]}, "lib": {"2.0": []},
                     "other": {"1.0": []}})
    with pytest.raises(RuntimeError, match="no set of versions"):
        sw.resolve([sw.parse_requirement("app")], target, {}, [], bad, log=lambda s: None)


# ------------------------------------------------------------------------------------------------
# pack + split + reassemble
# ------------------------------------------------------------------------------------------------

def make_wheel(directory, name, version, payload_size, requires=()):
    """A small but valid, installable pure-Python wheel."""
    dist = "%s-%s" % (name, version)
    path = os.path.join(str(directory), "%s-py3-none-any.whl" % dist)
    files = {
        "%s/__init__.py" % name: ("DATA = %r\n" % os.urandom(payload_size).hex()).encode(),
        "%s.dist-info/METADATA" % dist: ("Metadata-Version: 2.1\nName: %s\nVersion: %s\n%s"
                                         % (name, version, "".join(
                                             "Requires-Dist: %s\n" % r for r in requires))
                                         ).encode(),
        "%s.dist-info/WHEEL" % dist: b"Wheel-Version: 1.0\nGenerator: test\n"
                                     b"Root-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join("%s,,\n" % n for n in files) + "%s.dist-info/RECORD,,\n" % dist
    files["%s.dist-info/RECORD" % dist] = record.encode()
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        for n, data in files.items():
            zf.writestr(n, data)
    return path


@pytest.fixture
def wheels(tmp_path):
    d = tmp_path / "wheels"
    d.mkdir()
    paths = [make_wheel(d, "alpha", "1.0", 900), make_wheel(d, "beta", "2.1", 2500),
             make_wheel(d, "gamma", "0.3", 10, ["alpha>=1"])]
    return d, paths


def _sha(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def test_read_wheel_metadata(wheels):
    _, paths = wheels
    info = sw.read_wheel(paths[2])
    assert (info.name, info.version, info.requires) == ("gamma", "0.3", ["alpha>=1"])


def test_split_and_reassemble_round_trip(wheels, tmp_path):
    _, paths = wheels
    parts_dir = tmp_path / "parts"
    recs, tar, parts = sw.pack(paths, str(parts_dir), 1024)
    files = sorted(os.listdir(str(parts_dir)))
    assert files == [p["file"] for p in parts]
    assert files[0] == "wheelhouse.tar.part000"
    sizes = [os.path.getsize(str(parts_dir / f)) for f in files]
    assert all(s <= 1024 for s in sizes) and all(s == 1024 for s in sizes[:-1])
    assert sum(sizes) == tar["size"] and len(parts) == -(-tar["size"] // 1024)
    for p in parts:
        assert _sha(str(parts_dir / p["file"])) == p["sha256"]
    blob = b"".join(open(str(parts_dir / f), "rb").read() for f in files)
    assert hashlib.sha256(blob).hexdigest() == tar["sha256"]
    with tarfile.open(fileobj=io.BytesIO(blob)) as tf:
        names = tf.getnames()
        assert names == ["wheels/" + os.path.basename(p) for p in sorted(paths)]
        for p in paths:
            data = tf.extractfile("wheels/" + os.path.basename(p)).read()
            assert data == open(p, "rb").read()
    by_file = {r["file"]: r for r in recs}
    for p in paths:
        r = by_file[os.path.basename(p)]
        assert r["sha256"] == _sha(p) and r["size"] == os.path.getsize(p)
    # deterministic: packing again gives the same tar
    _, tar2, _ = sw.pack(paths, str(tmp_path / "parts2"), 4096)
    assert tar2["sha256"] == tar["sha256"]


def test_split_writer_many_parts_renames(tmp_path):
    w = sw.SplitWriter(str(tmp_path), 1)
    w.write(b"x" * 1001)
    w.close()
    assert len(w.parts) == 1001
    assert w.parts[0]["file"] == "wheelhouse.tar.part0000"
    assert sorted(os.listdir(str(tmp_path)))[-1] == "wheelhouse.tar.part1000"


def _pack_cli(wheels_dir, out):
    rc = sw.main(["pack", "--wheels", str(wheels_dir), "--out", str(out), "--part-size", "1K"])
    assert rc == 0
    return out / "parts"


def test_pack_cli_writes_manifest_and_copies_unstage(wheels, tmp_path):
    d, paths = wheels
    parts = _pack_cli(d, tmp_path / "out")
    m = json.loads((parts / "manifest.json").read_text())
    assert json.loads((tmp_path / "out" / "manifest.json").read_text()) == m
    assert (parts / "unstage_wheelhouse.sh").is_file()
    assert m["part_size"] == 1024 and m["wheels_total_bytes"] == sum(map(os.path.getsize, paths))
    for p in m["parts"]:
        assert _sha(str(parts / p["file"])) == p["sha256"]
        assert os.path.getsize(str(parts / p["file"])) == p["size"]


def test_strip_removes_members_and_their_record_lines(tmp_path):
    d = tmp_path / "w"
    d.mkdir()
    path = make_wheel(d, "alpha", "1.0", 50)
    with zipfile.ZipFile(path, "a") as zf:  # an extra "kernel library" to strip
        zf.writestr("alpha/_big_fa2.so", b"\0" * 4096)
    before = set(zipfile.ZipFile(path).namelist())
    removed = sw.strip_wheel(path, sw.parse_strips(["alpha:alpha/_big_*.so=not needed here",
                                                    "other:alpha/__init__.py"]))
    assert [(r["path"], r["size"], r["reason"]) for r in removed] == [
        ("alpha/_big_fa2.so", 4096, "not needed here")]
    with zipfile.ZipFile(path) as zf:
        assert set(zf.namelist()) == before - {"alpha/_big_fa2.so"}
        assert zf.testzip() is None
        record = zf.read("alpha-1.0.dist-info/RECORD").decode()
        assert "alpha/__init__.py," in record and "_big_fa2" not in record
    assert sw.strip_wheel(path, sw.parse_strips(["alpha:alpha/_big_*.so"])) == []  # idempotent
    for bad in ["alpha", "alpha:", ":x.so"]:
        with pytest.raises(ValueError):
            sw.parse_strips([bad])


def test_pack_cli_strip_is_recorded_and_checksums_match(tmp_path):
    d = tmp_path / "w"
    d.mkdir()
    path = make_wheel(d, "beta", "2.0", 20)
    with zipfile.ZipFile(path, "a") as zf:
        zf.writestr("beta/huge.bin", os.urandom(3000))
    rc = sw.main(["pack", "--wheels", str(d), "--out", str(tmp_path / "out"), "--part-size", "1K",
                  "--strip", "beta:beta/huge.bin=unused"])
    assert rc == 0
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert [r["path"] for r in m["stripped"]] == ["beta/huge.bin"]
    assert m["wheels"][0]["sha256"] == _sha(path)  # the manifest describes the stripped wheel


def test_resplit_cuts_the_same_tar_into_other_parts(wheels, tmp_path):
    d, _ = wheels
    parts = _pack_cli(d, tmp_path / "out")
    m = json.loads((parts / "manifest.json").read_text())
    rc = sw.main(["resplit", "--parts", str(parts), "--out", str(tmp_path / "re"), "--part-size", "700"])
    assert rc == 0
    new = tmp_path / "re" / "parts"
    m2 = json.loads((new / "manifest.json").read_text())
    assert (new / "unstage_wheelhouse.sh").is_file()
    assert m2["tar"] == m["tar"] and m2["wheels"] == m["wheels"] and m2["part_size"] == 700
    assert m2["resplit"]["from_part_size"] == 1024 and m2["resplit"]["from_parts"] == len(m["parts"])
    assert len(m2["parts"]) == -(-m["tar"]["size"] // 700)
    assert sorted(f for f in os.listdir(str(new)) if f.startswith("wheelhouse")) == \
        [p["file"] for p in m2["parts"]]
    blob = b""
    for p in m2["parts"]:
        data = open(str(new / p["file"]), "rb").read()
        assert len(data) == p["size"] <= 700 and hashlib.sha256(data).hexdigest() == p["sha256"]
        blob += data
    assert hashlib.sha256(blob).hexdigest() == m["tar"]["sha256"]


def test_resplit_refuses_bad_parts_and_its_own_folder(wheels, tmp_path, capsys):
    d, _ = wheels
    parts = _pack_cli(d, tmp_path / "out")
    args = ["resplit", "--parts", str(parts), "--part-size", "2K", "--out"]
    assert sw.main(args + [str(tmp_path / "out")]) == 2  # would overwrite what it reads
    assert "over the parts being read" in capsys.readouterr().err
    p1 = parts / "wheelhouse.tar.part001"
    good = p1.read_bytes()
    p1.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    assert sw.main(args + [str(tmp_path / "re")]) == 1
    assert "wheelhouse.tar.part001: sha256 differs" in capsys.readouterr().err
    assert not [f for f in os.listdir(str(tmp_path / "re" / "parts")) if f.startswith("wheelhouse")]
    p1.unlink()
    assert sw.main(args + [str(tmp_path / "re")]) == 1
    assert "parts missing: wheelhouse.tar.part001" in capsys.readouterr().err


@pytest.mark.skipif(not HAVE_BASH, reason="needs bash and tar")
def test_unstage_takes_resplit_parts(wheels, tmp_path):
    d, paths = wheels
    parts = _pack_cli(d, tmp_path / "out")
    assert sw.main(["resplit", "--parts", str(parts), "--out", str(tmp_path / "re"),
                    "--part-size", "3000"]) == 0
    work = tmp_path / "work"
    r = _unstage(tmp_path / "re" / "parts", "--verify-only", "--work", str(work))
    assert r.returncode == 0, r.stdout
    for p in paths:
        assert _sha(str(work / "wheels" / os.path.basename(p))) == _sha(p)


# ------------------------------------------------------------------------------------------------
# unstage_wheelhouse.sh
# ------------------------------------------------------------------------------------------------

def _unstage(parts, *args):
    return subprocess.run(["bash", UNSTAGE] + list(args) + [str(parts)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          universal_newlines=True, timeout=120)


@pytest.mark.skipif(not HAVE_BASH, reason="needs bash and tar")
def test_unstage_verify_only_ok(wheels, tmp_path):
    d, paths = wheels
    parts = _pack_cli(d, tmp_path / "out")
    work = tmp_path / "work"
    r = _unstage(parts, "--verify-only", "--work", str(work))
    assert r.returncode == 0, r.stdout
    assert "parts match their sha256" in r.stdout and "verify-only" in r.stdout
    for label in ("[manifest", "[presence", "[parts", "[reassemble", "[extract", "[total"):
        assert label in r.stdout
    for p in paths:
        assert _sha(str(work / "wheels" / os.path.basename(p))) == _sha(p)
    assert not (work / "wheelhouse.tar").exists()  # deleted unless --keep-tar


@pytest.mark.skipif(not HAVE_BASH, reason="needs bash and tar")
def test_unstage_detects_missing_part(wheels, tmp_path):
    d, _ = wheels
    parts = _pack_cli(d, tmp_path / "out")
    (parts / "wheelhouse.tar.part002").unlink()
    (parts / "wheelhouse.tar.part004").unlink()
    r = _unstage(parts, "--verify-only", "--work", str(tmp_path / "work"))
    assert r.returncode == 3, r.stdout
    assert "ERROR" in r.stdout and "missing" in r.stdout
    assert "wheelhouse.tar.part002" in r.stdout and "wheelhouse.tar.part004" in r.stdout
    assert not (tmp_path / "work").exists()  # nothing was touched


@pytest.mark.skipif(not HAVE_BASH, reason="needs bash and tar")
def test_unstage_detects_corrupt_and_truncated_parts(wheels, tmp_path):
    d, _ = wheels
    parts = _pack_cli(d, tmp_path / "out")
    p1 = parts / "wheelhouse.tar.part001"
    data = bytearray(p1.read_bytes())
    data[100] ^= 0xFF  # same size, one byte flipped
    p1.write_bytes(bytes(data))
    p3 = parts / "wheelhouse.tar.part003"
    p3.write_bytes(p3.read_bytes()[:-7])  # a transfer cut short
    r = _unstage(parts, "--verify-only", "--work", str(tmp_path / "work"))
    assert r.returncode == 4, r.stdout
    assert "corrupt part: wheelhouse.tar.part001 (sha256" in r.stdout
    assert "corrupt part: wheelhouse.tar.part003 (size" in r.stdout


@pytest.mark.skipif(not HAVE_BASH, reason="needs bash and tar")
def test_unstage_usage_errors(wheels, tmp_path):
    d, _ = wheels
    parts = _pack_cli(d, tmp_path / "out")
    r = _unstage(parts, "--verify-only", "--manifest", str(tmp_path / "nope.json"))
    assert r.returncode == 2 and "manifest not found" in r.stdout
    (tmp_path / "bad.json").write_text("{not json")
    r = _unstage(parts, "--verify-only", "--manifest", str(tmp_path / "bad.json"))
    assert r.returncode == 2 and "cannot read the manifest" in r.stdout
    r = _unstage(parts, "--bogus")
    assert r.returncode == 2


@pytest.mark.skipif(not HAVE_BASH, reason="needs bash and tar")
def test_unstage_installs_into_target(wheels, tmp_path):
    if subprocess.run([sys.executable, "-m", "pip", "--version"],
                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode != 0:
        pytest.skip("no pip")
    d, _ = wheels
    parts = _pack_cli(d, tmp_path / "out")
    site = tmp_path / "site"
    r = _unstage(parts, "--python", sys.executable, "--target", str(site),
                 "--work", str(tmp_path / "work"), "--pip-arg=--no-compile")
    assert r.returncode == 0, r.stdout
    assert "[install" in r.stdout and "export PYTHONPATH=%s" % site in r.stdout
    out = subprocess.run([sys.executable, "-c", "import alpha, beta, gamma; print('ok')"],
                         env=dict(os.environ, PYTHONPATH=str(site)), stdout=subprocess.PIPE,
                         universal_newlines=True)
    assert out.stdout.strip() == "ok"
