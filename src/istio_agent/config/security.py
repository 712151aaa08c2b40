"""Security settings of the workload agent (SDS, CA client, certificates), from Istio's env names.

Well-known paths are relative to the agent's working directory, as in Istio (``./var/run/...``);
``workdir`` makes them absolute so several agents can run side by side in their own directories.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from istio_agent.config.env import ConfigError, Env
from istio_agent.config.headers import header_value_from_env, headers_from_env
from istio_agent.config.proxy_config import ProxyConfig

SDS_SOCKET_DIR = "var/run/secrets/workload-spiffe-uds"
DEFAULT_SDS_SOCKET_FILE = "socket"
FILES_SOCKET = "var/run/secrets/credential-uds/files-socket"
WORKLOAD_CREDENTIALS_DIR = "var/run/secrets/workload-spiffe-credentials"
LEGACY_CERTS_DIR = "etc/certs"
ISTIO_CA_ROOT = "var/run/secrets/istio/root-cert.pem"
TOKEN_PATH = "var/run/secrets/tokens/istio-token"
CRL_PATH = "/var/run/secrets/istio/crl/ca-crl.pem"
CERT_CHAIN_FILE, KEY_FILE, ROOT_CERT_FILE = "cert-chain.pem", "key.pem", "root-cert.pem"
OS_CA_BUNDLES = (
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/tls/certs/ca-bundle.crt",
    "/etc/ssl/ca-bundle.pem",
    "/etc/pki/tls/cacert.pem",
    "/etc/pki/ca-trust/extracted/pem/tls-ca-bundle.pem",
    "/etc/ssl/cert.pem",
    "/usr/local/etc/ssl/cert.pem",
    "/etc/ssl/certs/ca-certificates",
)
KNOWN_CA_PROVIDERS = ("Citadel",)
MIN_SECRET_TTL = timedelta(seconds=1)
MIN_RSA_KEY_SIZE = 2048
"""Istio's minimum (security/pkg/pkiutil/generate_csr.go)."""
MAX_RSA_KEY_SIZE = 8192
"""Beyond Istio, which sets no maximum: Go's TLS stack (crypto/tls, proxyless gRPC clients and
istiod) refuses peers whose RSA key is larger, and generating a larger key takes minutes of CPU."""
FILE_LOAD_TIMEOUT = timedelta(seconds=10)
"""How long a mounted certificate file is retried while it may be half-written (Istio's 10 s); the
retries start at FILE_DEBOUNCE_DURATION, which therefore cannot be longer."""
KNOWN_CREDENTIAL_FETCHERS = ("JWT", "", "Mock")


def os_ca_bundle() -> Path | None:
    """The first existing OS CA bundle (Istio's CARootPath), or None."""
    return next((Path(p) for p in OS_CA_BUNDLES if Path(p).exists()), None)


def is_plaintext_address(address: str) -> bool:
    """Istio dials ``:15010`` style addresses without TLS (debug / IP-secure networks)."""
    return address.endswith(":15010")


@dataclass(frozen=True)
class SecuritySettings:
    workdir: Path
    trust_domain: str = "cluster.local"
    pod_namespace: str = ""
    service_account: str = ""
    secret_ttl: timedelta = timedelta(hours=24)
    grace_period_ratio: float = 0.5
    grace_period_ratio_jitter: float = 0.01
    rsa_key_size: int = 2048
    ecc_signature_algorithm: str = ""
    ecc_curve: str = "P256"
    pkcs8_key: bool = False
    ca_addr: str = ""
    ca_addr_defaulted: bool = True
    ca_provider: str = "Citadel"
    ca_root_ca: str = ""
    ca_headers: dict[str, str] = field(default_factory=dict)
    istiod_san: str = ""
    pilot_cert_provider: str = "istiod"
    prov_cert: Path | None = None
    output_certs: Path | None = None
    file_mounted_certs: bool = False
    jwt_policy: str = "third-party-jwt"
    credential_fetcher_type: str = "JWT"
    cluster_id: str = ""
    cert_signer: str = ""
    workload_identity_socket_file: str = DEFAULT_SDS_SOCKET_FILE
    file_debounce: timedelta = timedelta(milliseconds=100)
    enable_ca_crl: bool = True
    output_world_readable: bool = False
    cert_chain_file: Path = Path()
    key_file: Path = Path()
    root_cert_file: Path = Path()

    # -- derived paths ---------------------------------------------------------------------------
    @property
    def spiffe_id(self) -> str:
        return f"spiffe://{self.trust_domain}/ns/{self.pod_namespace}/sa/{self.service_account}"

    @property
    def sds_socket_path(self) -> Path:
        return self.workdir / SDS_SOCKET_DIR / self.workload_identity_socket_file

    @property
    def default_sds_socket_path(self) -> Path:
        return self.workdir / SDS_SOCKET_DIR / DEFAULT_SDS_SOCKET_FILE

    @property
    def files_socket_path(self) -> Path:
        return self.workdir / FILES_SOCKET

    @property
    def workload_credentials_dir(self) -> Path:
        return self.workdir / WORKLOAD_CREDENTIALS_DIR

    @property
    def token_path(self) -> Path:
        return self.workdir / TOKEN_PATH

    @property
    def ca_plaintext(self) -> bool:
        return is_plaintext_address(self.ca_addr)

    @property
    def ca_server_name(self) -> str:
        """TLS server name for the CA: ISTIOD_SAN when the address was defaulted, ``localhost`` mapped to istiod."""
        if self.ca_addr_defaulted and self.istiod_san:
            return self.istiod_san
        host = self.ca_addr.rpartition(":")[0].strip("[]")
        return "istiod.istio-system.svc" if "localhost" in host else host

    def ca_root_path(self) -> Path | None:
        """Istio's FindRootCAForCA; None means the OS trust store. Raises ConfigError when required and absent."""
        if self.ca_root_ca == "SYSTEM":
            return None
        if self.ca_root_ca:
            path = self._resolve(self.ca_root_ca)
        elif self.pilot_cert_provider == "custom":
            path = self.workdir / LEGACY_CERTS_DIR / ROOT_CERT_FILE
        elif self.prov_cert is not None:
            return self.prov_cert / ROOT_CERT_FILE
        elif self.pilot_cert_provider == "none":
            raise ConfigError("root CA file for CA required but configured provider as none")
        else:
            path = self.workdir / ISTIO_CA_ROOT
        if not path.exists():
            raise ConfigError(f"root CA file for CA does not exist {path}")
        return path

    def _resolve(self, path: str) -> Path:
        return Path(path) if Path(path).is_absolute() else self.workdir / path

    # -- construction ----------------------------------------------------------------------------
    @classmethod
    def from_env(cls, env: Env, workdir: Path, proxy_config: ProxyConfig | None = None) -> SecuritySettings:
        """Read Istio's security env vars; raise ConfigError naming the variable on any invalid value."""
        proxy_config = proxy_config or ProxyConfig()
        ratio = env.number("SECRET_GRACE_PERIOD_RATIO", 0.5, minimum=0.0, maximum=1.0)
        jitter = env.number("SECRET_GRACE_PERIOD_RATIO_JITTER", 0.01, minimum=0.0, maximum=1.0)
        ttl = env.duration("SECRET_TTL", timedelta(hours=24), minimum=MIN_SECRET_TTL)
        rsa_bits = env.integer(
            "WORKLOAD_RSA_KEY_SIZE", 2048, minimum=MIN_RSA_KEY_SIZE, maximum=MAX_RSA_KEY_SIZE
        )
        ecc_alg = env.text("ECC_SIGNATURE_ALGORITHM")
        if ecc_alg not in ("", "ECDSA"):
            raise ConfigError(
                f"invalid value for ECC_SIGNATURE_ALGORITHM={ecc_alg!r}: only ECDSA is supported"
            )
        curve = env.text("ECC_CURVE", "P256") or "P256"
        if curve not in ("P256", "P384"):
            raise ConfigError(f"invalid value for ECC_CURVE={curve!r}: use P256 or P384")
        provider = env.text("CA_PROVIDER", "Citadel") or "Citadel"
        if provider not in KNOWN_CA_PROVIDERS:
            raise ConfigError(f'invalid value for CA_PROVIDER: CA provider "{provider}" not registered')
        fetcher = env.text("CREDENTIAL_FETCHER_TYPE", "JWT")
        if fetcher not in KNOWN_CREDENTIAL_FETCHERS:
            raise ConfigError(
                f"invalid value for CREDENTIAL_FETCHER_TYPE: invalid credential fetcher type {fetcher}"
            )
        socket_file = (
            env.text("WORKLOAD_IDENTITY_SOCKET_FILE", DEFAULT_SDS_SOCKET_FILE) or DEFAULT_SDS_SOCKET_FILE
        )
        if "/" in socket_file:
            raise ConfigError(
                "invalid value for WORKLOAD_IDENTITY_SOCKET_FILE: workload identity socket file override "
                f"must be a filename, not a path: {socket_file}"
            )
        prov_cert = env.text("PROV_CERT")
        file_mounted = env.flag("FILE_MOUNTED_CERTS")
        if prov_cert and file_mounted:
            raise ConfigError("invalid options: PROV_CERT and FILE_MOUNTED_CERTS are mutually exclusive")
        output_certs = env.text("OUTPUT_CERTS")
        ca_addr = env.text("CA_ADDR")

        def resolve(path: str) -> Path:
            return Path(path) if Path(path).is_absolute() else workdir / path

        legacy = workdir / LEGACY_CERTS_DIR
        return cls(
            workdir=workdir,
            trust_domain=env.text("TRUST_DOMAIN", "cluster.local") or "cluster.local",
            pod_namespace=env.text("POD_NAMESPACE"),
            service_account=env.text("SERVICE_ACCOUNT"),
            secret_ttl=ttl,
            grace_period_ratio=ratio,
            grace_period_ratio_jitter=jitter,
            rsa_key_size=rsa_bits,
            ecc_signature_algorithm=ecc_alg,
            ecc_curve=curve,
            pkcs8_key=env.flag("PKCS8_KEY"),
            ca_addr=ca_addr or proxy_config.discovery_address,
            ca_addr_defaulted=not ca_addr,
            ca_provider=provider,
            ca_root_ca=env.text("CA_ROOT_CA"),
            ca_headers=headers_from_env(env, "CA_HEADER_"),
            istiod_san=env.text("ISTIOD_SAN"),
            pilot_cert_provider=env.text("PILOT_CERT_PROVIDER", "istiod") or "istiod",
            prov_cert=resolve(prov_cert) if prov_cert else None,
            output_certs=resolve(output_certs) if output_certs else None,
            file_mounted_certs=file_mounted,
            jwt_policy=env.text("JWT_POLICY", "third-party-jwt"),
            credential_fetcher_type=fetcher,
            cluster_id=header_value_from_env(env, "ISTIO_META_CLUSTER_ID"),
            cert_signer=env.text("ISTIO_META_CERT_SIGNER"),
            workload_identity_socket_file=socket_file,
            file_debounce=env.duration(
                "FILE_DEBOUNCE_DURATION",
                timedelta(milliseconds=100),
                minimum=timedelta(0),
                maximum=FILE_LOAD_TIMEOUT,
            ),
            enable_ca_crl=env.flag("PILOT_ENABLE_CA_CRL", True),
            output_world_readable=bool(env.text("KUBERNETES_SERVICE_HOST")),
            cert_chain_file=legacy / CERT_CHAIN_FILE,
            key_file=legacy / KEY_FILE,
            root_cert_file=legacy / ROOT_CERT_FILE,
        )
