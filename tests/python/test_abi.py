"""The ctypes mirror of the C ABI against the layout the library itself reports
(opgraft_abi_layout: offsetof and sizeof as the C compiler laid the structs out)."""
import ctypes

from opgraft import _lib


def _ctypes_layout(cls) -> dict:
    return {name: [getattr(cls, name).offset, getattr(cls, name).size] for name, *_ in cls._fields_}


def test_every_public_struct_is_mirrored_field_by_field():
    layout = _lib.abi_layout()
    structs = layout["structs"]
    assert set(structs) == set(_lib.STRUCTS), "a C struct without a mirror, or a mirror without a struct"
    for name, cls in _lib.STRUCTS.items():
        c = structs[name]
        assert ctypes.sizeof(cls) == c["size"], name
        assert _ctypes_layout(cls) == c["fields"], name


def test_status_codes_match():
    assert _lib.abi_layout()["status"] == {f"OPGRAFT_{k}": v for k, v in _lib.STATUS.items()}
    for k, v in _lib.STATUS.items():
        assert getattr(_lib, k) == v
        assert _lib.lib().opgraft_status_name(v).decode() == f"OPGRAFT_{k}"


def test_the_abi_version_is_the_headers():
    import os
    import re

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    header = open(os.path.join(root, "include", "opgraft", "opgraft.h"), encoding="utf-8").read()
    version = int(re.search(r"#define OPGRAFT_ABI_VERSION (\d+)", header).group(1))
    assert _lib.abi_layout()["abi"] == version


def test_the_registered_ops():
    assert {"moe", "linear", "attention"} <= set(_lib.op_names())
