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


def test_tunables_tag_takes_fifos_and_bytes_that_are_not_utf8(monkeypatch, tmp_path):
    """vLLM hashes this factor while it builds its compile-cache key: a FIFO as the tune file must
    not wait for a writer, and a value that is not UTF-8 must still change the tag (vLLM would skip
    a factor that raises, and reuse a graph traced under other tunables)."""
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    monkeypatch.setenv("OPGRAFT_TUNE_FILE", str(fifo))
    with_fifo = compat.tunables_tag()
    monkeypatch.delenv("OPGRAFT_TUNE_FILE")
    plain = compat.tunables_tag()
    assert with_fifo != plain
    monkeypatch.setitem(os.environb, b"OPGRAFT_TUNE_MOE_MAX_TOKENS", b"\xff")
    odd = compat.tunables_tag()
    monkeypatch.setitem(os.environb, b"OPGRAFT_TUNE_MOE_MAX_TOKENS", b"\xfe")
    assert len({plain, odd, compat.tunables_tag()}) == 3
