"""opgraft.vllm.compat without vLLM: the package tag in every seam's compile-cache factor."""
import os

from opgraft.vllm import compat


def test_source_digest_follows_the_python_source_only(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.py").write_text("y = 2\n")
    d = compat.source_digest(str(tmp_path))
    assert d == compat.source_digest(str(tmp_path)) and len(d) == 64
    (tmp_path / "notes.txt").write_text("not source")
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "a.py").write_text("a cache, not source")
    assert compat.source_digest(str(tmp_path)) == d
    (tmp_path / "sub" / "b.py").write_text("y = 3\n")
    changed = compat.source_digest(str(tmp_path))
    assert changed != d
    os.rename(tmp_path / "sub" / "b.py", tmp_path / "b.py")  # same bytes, another place
    assert compat.source_digest(str(tmp_path)) not in (d, changed)


def test_package_tag_names_the_version_and_this_source():
    from opgraft import __version__

    root = os.path.dirname(os.path.dirname(os.path.abspath(compat.__file__)))
    assert compat.package_tag() == f"opgraft {__version__} (source {compat.source_digest(root)[:16]})"


def test_an_unreadable_source_gives_a_key_no_cache_shares(monkeypatch):
    def unreadable(root):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(compat, "source_digest", unreadable)
    compat.package_tag.cache_clear()
    try:
        a = compat.package_tag()
        compat.package_tag.cache_clear()
        assert a.startswith("opgraft ") and "unreadable" in a and compat.package_tag() != a
    finally:
        compat.package_tag.cache_clear()
