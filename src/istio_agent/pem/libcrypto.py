"""Keys and signatures through the OpenSSL libcrypto that Python's ``ssl`` module already mapped.

Why: ``cryptography`` brings its own 8 MB Rust extension into every agent, while the ``_ssl``
extension has libcrypto (OpenSSL 3) mapped anyway. The library is found in ``/proc/self/maps``
after importing ``_ssl`` (``ctypes.util.find_library`` would spawn ldconfig or a compiler) and
loaded on first use; importing this module does nothing.

Only EVP functions on opaque pointers are called, never a struct layout. Every return value is
checked; a failure raises :class:`CryptoError` with OpenSSL's reasons, and every object made here
(BIO, EVP_PKEY, EVP_PKEY_CTX, EVP_MD_CTX) is freed in ``finally`` (keys by :class:`PrivateKey`'s
context manager). ctypes releases the GIL during each call.
"""

from __future__ import annotations

import ctypes
import os
import threading
from dataclasses import dataclass
from types import TracebackType
from typing import Any

_P = ctypes.c_void_p
_PP = ctypes.POINTER(ctypes.c_void_p)
_INT = ctypes.c_int
_SIZE = ctypes.c_size_t
_BYTES = ctypes.c_char_p

_PROTOTYPES: dict[str, tuple[Any, tuple[Any, ...]]] = {
    "ERR_get_error": (ctypes.c_ulong, ()),
    "ERR_error_string_n": (None, (ctypes.c_ulong, _P, _SIZE)),
    "ERR_clear_error": (None, ()),
    "BIO_s_mem": (_P, ()),
    "BIO_new": (_P, (_P,)),
    "BIO_free": (_INT, (_P,)),
    "BIO_ctrl_pending": (_SIZE, (_P,)),
    "BIO_read": (_INT, (_P, _P, _INT)),
    "EVP_PKEY_CTX_new_from_name": (_P, (_P, _BYTES, _BYTES)),
    "EVP_PKEY_CTX_free": (None, (_P,)),
    "EVP_PKEY_keygen_init": (_INT, (_P,)),
    "EVP_PKEY_CTX_set_rsa_keygen_bits": (_INT, (_P, _INT)),
    "EVP_PKEY_CTX_set_group_name": (_INT, (_P, _BYTES)),
    "EVP_PKEY_generate": (_INT, (_P, _PP)),
    "EVP_PKEY_free": (None, (_P,)),
    "i2d_PUBKEY": (_INT, (_P, _PP)),
    "d2i_PUBKEY": (_P, (_P, _PP, ctypes.c_long)),
    "d2i_AutoPrivateKey": (_P, (_P, _PP, ctypes.c_long)),
    "PEM_write_bio_PrivateKey": (_INT, (_P, _P, _P, _P, _INT, _P, _P)),
    "PEM_write_bio_PrivateKey_traditional": (_INT, (_P, _P, _P, _P, _INT, _P, _P)),
    "EVP_get_digestbyname": (_P, (_BYTES,)),
    "EVP_MD_CTX_new": (_P, ()),
    "EVP_MD_CTX_free": (None, (_P,)),
    "EVP_DigestSignInit": (_INT, (_P, _PP, _P, _P, _P)),
    "EVP_DigestSign": (_INT, (_P, _P, ctypes.POINTER(_SIZE), _BYTES, _SIZE)),
    "EVP_DigestVerifyInit": (_INT, (_P, _PP, _P, _P, _P)),
    "EVP_DigestVerify": (_INT, (_P, _BYTES, _SIZE, _BYTES, _SIZE)),
    "EVP_PKEY_CTX_set_rsa_padding": (_INT, (_P, _INT)),
    "EVP_PKEY_CTX_set_rsa_pss_saltlen": (_INT, (_P, _INT)),
    "EVP_PKEY_CTX_set_rsa_mgf1_md": (_INT, (_P, _P)),
}
RSA_PKCS1_PSS_PADDING = 6


class CryptoError(ValueError):
    """A libcrypto operation failed; the message carries OpenSSL's reasons (never key material)."""


_lock = threading.Lock()
_loaded: ctypes.CDLL | None = None


def mapped_libcrypto(maps: str = "/proc/self/maps") -> str:
    """The path of the libcrypto shared object this process has mapped (after importing ``_ssl``)."""
    import _ssl  # noqa: F401 - maps libcrypto; already imported in the agent

    with open(maps, encoding="utf-8", errors="replace") as lines:
        for line in lines:
            fields = line.split(maxsplit=5)
            if len(fields) == 6:
                path = fields[5].strip()
                name = os.path.basename(path)
                if name.startswith("libcrypto") and ".so" in name:
                    return path
    raise CryptoError(
        "no libcrypto shared library is mapped in this process (is Python's ssl linked statically?)"
    )


def _lib() -> ctypes.CDLL:
    """libcrypto with every function we call declared (argtypes and restype), loaded once."""
    global _loaded
    with _lock:
        if _loaded is None:
            library = ctypes.CDLL(mapped_libcrypto())
            for name, (restype, argtypes) in _PROTOTYPES.items():
                function = getattr(library, name)
                function.restype = restype
                function.argtypes = list(argtypes)
            _loaded = library
        return _loaded


def _reasons() -> str:
    """OpenSSL's queued error strings (the queue is emptied)."""
    lib = _lib()
    reasons = []
    while code := lib.ERR_get_error():
        buffer = ctypes.create_string_buffer(256)
        lib.ERR_error_string_n(code, buffer, len(buffer))
        reasons.append(buffer.value.decode("ascii", "replace"))
    return "; ".join(reasons) or "no reason given by OpenSSL"


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise CryptoError(f"{what} failed: {_reasons()}")


def _digest(name: str | None) -> int | None:
    """The EVP_MD for ``SHA256`` etc. (not owned: nothing to free); None for none (Ed25519)."""
    if name is None:
        return None
    md: int | None = _lib().EVP_get_digestbyname(name.encode("ascii"))
    _check(bool(md), f"looking up digest {name}")
    return md


class PrivateKey:
    """An EVP_PKEY owned by Python: use ``with`` so it is freed."""

    def __init__(self, handle: int) -> None:
        self._handle: int | None = handle

    @property
    def handle(self) -> int:
        if self._handle is None:
            raise CryptoError("the private key was freed")
        return self._handle

    def close(self) -> None:
        if self._handle is not None:
            _lib().EVP_PKEY_free(self._handle)
            self._handle = None

    def __enter__(self) -> PrivateKey:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()

    @classmethod
    def generate_rsa(cls, bits: int) -> PrivateKey:
        """A new RSA key (public exponent 65537, OpenSSL's default)."""
        return cls._generate(b"RSA", lambda lib, ctx: lib.EVP_PKEY_CTX_set_rsa_keygen_bits(ctx, bits) > 0)

    @classmethod
    def generate_ec(cls, group: str) -> PrivateKey:
        """A new EC key on a named curve (``P-256``, ``P-384``)."""
        name = group.encode("ascii")
        return cls._generate(b"EC", lambda lib, ctx: lib.EVP_PKEY_CTX_set_group_name(ctx, name) > 0)

    @classmethod
    def _generate(cls, algorithm: bytes, configure: Any) -> PrivateKey:
        lib = _lib()
        lib.ERR_clear_error()
        ctx = lib.EVP_PKEY_CTX_new_from_name(None, algorithm, None)
        _check(bool(ctx), f"creating a {algorithm.decode()} key context")
        try:
            _check(lib.EVP_PKEY_keygen_init(ctx) > 0, "initialising key generation")
            _check(configure(lib, ctx), f"setting the {algorithm.decode()} key parameters")
            key = ctypes.c_void_p()
            _check(lib.EVP_PKEY_generate(ctx, ctypes.byref(key)) > 0 and bool(key.value), "generating a key")
        finally:
            lib.EVP_PKEY_CTX_free(ctx)
        assert key.value is not None
        return cls(key.value)

    @classmethod
    def from_der(cls, data: bytes) -> PrivateKey:
        """An unencrypted PKCS#8, PKCS#1 (RSA) or SEC1 (EC) private key."""
        lib = _lib()
        lib.ERR_clear_error()
        buffer = ctypes.create_string_buffer(data, len(data))
        cursor = ctypes.c_void_p(ctypes.addressof(buffer))
        key = lib.d2i_AutoPrivateKey(None, ctypes.byref(cursor), len(data))
        _check(bool(key), "reading the private key")
        return cls(key)

    def to_pem(self, pkcs8: bool) -> bytes:
        """Unencrypted PEM: ``PRIVATE KEY`` (PKCS#8), or ``RSA PRIVATE KEY`` / ``EC PRIVATE KEY``."""
        lib = _lib()
        lib.ERR_clear_error()
        write = lib.PEM_write_bio_PrivateKey if pkcs8 else lib.PEM_write_bio_PrivateKey_traditional
        bio = lib.BIO_new(lib.BIO_s_mem())
        _check(bool(bio), "creating a memory BIO")
        try:
            _check(write(bio, self.handle, None, None, 0, None, None) == 1, "writing the private key")
            size = lib.BIO_ctrl_pending(bio)
            out = ctypes.create_string_buffer(size)
            _check(lib.BIO_read(bio, out, size) == size, "reading the private key PEM")
            return out.raw
        finally:
            lib.BIO_free(bio)

    def public_key_der(self) -> bytes:
        """The SubjectPublicKeyInfo DER of the key."""
        lib = _lib()
        lib.ERR_clear_error()
        size = lib.i2d_PUBKEY(self.handle, None)
        _check(size > 0, "measuring the public key")
        out = ctypes.create_string_buffer(size)
        cursor = ctypes.c_void_p(ctypes.addressof(out))
        _check(lib.i2d_PUBKEY(self.handle, ctypes.byref(cursor)) == size, "encoding the public key")
        return out.raw

    def sign(self, data: bytes, digest: str) -> bytes:
        """The signature of ``data``: PKCS#1 v1.5 for RSA, DER ECDSA-Sig-Value for EC."""
        lib = _lib()
        lib.ERR_clear_error()
        md = _digest(digest)
        ctx = lib.EVP_MD_CTX_new()
        _check(bool(ctx), "creating a digest context")
        try:
            _check(lib.EVP_DigestSignInit(ctx, None, md, None, self.handle) == 1, "initialising signing")
            size = _SIZE(0)
            _check(
                lib.EVP_DigestSign(ctx, None, ctypes.byref(size), data, len(data)) == 1,
                "sizing the signature",
            )
            out = ctypes.create_string_buffer(size.value)
            _check(lib.EVP_DigestSign(ctx, out, ctypes.byref(size), data, len(data)) == 1, "signing")
            return out.raw[: size.value]
        finally:
            lib.EVP_MD_CTX_free(ctx)


def public_key_der_of(private_key_der: bytes) -> bytes:
    """The SubjectPublicKeyInfo DER of a private key (to compare it with a certificate's)."""
    with PrivateKey.from_der(private_key_der) as key:
        return key.public_key_der()


def _public_key(spki: bytes) -> int:
    """An EVP_PKEY read from SubjectPublicKeyInfo DER; the caller frees it."""
    lib = _lib()
    lib.ERR_clear_error()
    buffer = ctypes.create_string_buffer(spki, len(spki))
    cursor = ctypes.c_void_p(ctypes.addressof(buffer))
    key: int | None = lib.d2i_PUBKEY(None, ctypes.byref(cursor), len(spki))
    _check(bool(key), "reading the public key")
    assert key is not None
    return key


def normalized_public_key(spki: bytes) -> bytes:
    """SubjectPublicKeyInfo DER as OpenSSL writes it (what :meth:`PrivateKey.public_key_der` gives)."""
    key = PrivateKey(_public_key(spki))  # only freed and encoded, never used to sign
    with key:
        return key.public_key_der()


@dataclass(frozen=True)
class Pss:
    """RSASSA-PSS parameters: the MGF1 digest and the salt length."""

    mgf1_digest: str
    salt_length: int


def verify(spki: bytes, signature: bytes, data: bytes, digest: str | None, pss: Pss | None = None) -> bool:
    """Whether ``signature`` over ``data`` is valid for the public key ``spki`` (DER).

    False for a wrong signature; CryptoError when the key cannot be read or the algorithm not used.
    """
    lib = _lib()
    key = _public_key(spki)
    ctx = None
    try:
        md = _digest(digest)
        ctx = lib.EVP_MD_CTX_new()
        _check(bool(ctx), "creating a digest context")
        key_ctx = ctypes.c_void_p()
        _check(
            lib.EVP_DigestVerifyInit(ctx, ctypes.byref(key_ctx), md, None, key) == 1,
            "initialising verification",
        )
        if pss is not None:
            _check(lib.EVP_PKEY_CTX_set_rsa_padding(key_ctx, RSA_PKCS1_PSS_PADDING) > 0, "selecting RSA-PSS")
            _check(
                lib.EVP_PKEY_CTX_set_rsa_pss_saltlen(key_ctx, pss.salt_length) > 0,
                "setting the PSS salt length",
            )
            mgf1 = _digest(pss.mgf1_digest)
            _check(lib.EVP_PKEY_CTX_set_rsa_mgf1_md(key_ctx, mgf1) > 0, "setting the MGF1 digest")
        # 1: valid; 0 or -1 (e.g. a signature that is not even DER): not a signature of this key.
        valid = lib.EVP_DigestVerify(ctx, signature, len(signature), data, len(data)) == 1
        lib.ERR_clear_error()  # a wrong signature leaves its reasons queued
        return bool(valid)
    finally:
        if ctx:
            lib.EVP_MD_CTX_free(ctx)
        lib.EVP_PKEY_free(key)
