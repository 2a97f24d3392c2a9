"""The job's secret: where each process gets it, the store namespace derived from it, and the proofs made with it.

Every job that runs over processes has a secret of 256 random bits (`secrets.token_bytes`). `shoal run`
on one host makes a fresh one per job unless the user gives one; a job over several hosts (`--nnodes`,
a hostfile, torchrun, srun, a PyTorchJob) needs the same one on every node, given by the user:

- `SHOAL_JOB_SECRET`: the secret as hex (at least 32 hex digits, 128 bits: `openssl rand -hex 32`), or
- `SHOAL_JOB_SECRET_FILE`: a file holding that hex, readable by its owner only (mode 0600 or stricter).

Processes get it through the environment (never argv: other users can read a process's command line,
not its environment). Knowing it is what makes a process one of the job's:

- `namespace`: every key the job's processes use in the rendezvous store lives under a prefix derived
  from the secret, which keeps jobs of different secrets apart; it hides nothing from a process that lists
  the store's keys, and authorises nothing: the values that steer the job carry MACs under the secret
  (shoal.comm.signed_store);
- `proof`: HMAC-SHA256 over both sides' nonces, checked with `hmac.compare_digest`, in every handshake
  (a process meeting the world: `introduce`/`check_peer`; a Downpour stub and its server: channels).
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from pathlib import Path
from typing import Mapping, Optional

from shoal.errors import ShoalError

SECRET_VARIABLE = "SHOAL_JOB_SECRET"
SECRET_FILE_VARIABLE = "SHOAL_JOB_SECRET_FILE"
SECRET_FILE = "job.secret"  # WORKSPACE/logs/job.secret (0600), for `shoal run JOB --rejoin RANK` by hand
MIN_HEX_DIGITS = 32  # 128 bits
NONCE_BYTES = 32
PROOF_BYTES = hashlib.sha256().digest_size


class SecretError(ShoalError, ValueError):
    """The job's secret is missing, malformed, readable by others, or not the one the job's other processes hold."""


def new_secret() -> bytes:
    return secrets.token_bytes(32)


def to_text(secret: bytes) -> str:
    return secret.hex()


def _parse(text: str, where: str) -> bytes:
    text = text.strip()
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        raise SecretError(f"{where}: the job secret must be hex digits (make one with `openssl rand -hex 32`)") from None
    if len(text) < MIN_HEX_DIGITS:
        raise SecretError(f"{where}: the job secret has {len(text)} hex digits; at least {MIN_HEX_DIGITS} (128 bits) are needed")
    return secret


def read_secret_file(path: Path) -> bytes:
    """The secret in `path`, refused when others may read the file (one line naming it)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as err:
        raise SecretError(f"{path}: cannot read the job secret: {err.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise SecretError(f"{path}: the job secret file is not a regular file")
        if info.st_mode & 0o077:
            raise SecretError(f"{path}: the job secret file may be read by others (mode {stat.S_IMODE(info.st_mode):o}); "
                              "chmod 600 it")
        if info.st_uid != os.getuid():
            raise SecretError(f"{path}: the job secret file belongs to another user")
        data = os.read(fd, 4096)
    finally:
        os.close(fd)
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        raise SecretError(f"{path}: the job secret must be hex digits (make one with `openssl rand -hex 32`)") from None
    return _parse(text, str(path))


def given_secret(env: Mapping[str, str] = os.environ) -> Optional[bytes]:
    """The secret the user gave (SHOAL_JOB_SECRET, else SHOAL_JOB_SECRET_FILE); None when neither is set."""
    if env.get(SECRET_VARIABLE):
        return _parse(env[SECRET_VARIABLE], SECRET_VARIABLE)
    if env.get(SECRET_FILE_VARIABLE):
        return read_secret_file(Path(env[SECRET_FILE_VARIABLE]))
    return None


def required_secret(what: str, env: Mapping[str, str] = os.environ) -> bytes:
    """The secret a job over several hosts needs on every node: one line saying how to give it when it is missing."""
    secret = given_secret(env)
    if secret is None:
        raise SecretError(f"{what} needs the job's secret on every node: set {SECRET_VARIABLE} to the same hex string "
                          f"everywhere (`openssl rand -hex 32`) or {SECRET_FILE_VARIABLE} to a file holding it (mode 0600)")
    return secret


def process_secret() -> Optional[bytes]:
    """This process's copy of the job's secret (from the environment its launcher gave it); None: the job has none."""
    return given_secret()


def namespace(secret: bytes) -> str:
    """The store prefix of the job's keys: unguessable without the secret, and revealing nothing of it."""
    return hmac.new(secret, b"shoal store namespace", hashlib.sha256).hexdigest()[:32]


def proof(secret: bytes, role: str, context: str, *nonces: bytes) -> bytes:
    """HMAC-SHA256 binding the prover's role, what it proves (a channel's or a rank's name) and every nonce."""
    mac = hmac.new(secret, f"shoal/{role}/{context}".encode(), hashlib.sha256)
    for nonce in nonces:
        mac.update(len(nonce).to_bytes(2, "big") + nonce)
    return mac.digest()


def proves(secret: bytes, claimed: bytes, role: str, context: str, *nonces: bytes) -> bool:
    return hmac.compare_digest(claimed, proof(secret, role, context, *nonces))


# -- meeting the world: every rank introduces itself with a proof; each checks the others' ---------------------
def introduce(store, rank: int, secret: bytes) -> None:
    """Say, in the store's public part, that rank `rank` holds a secret (a nonce and its proof: nothing to replay)."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    store.set(f"rank{rank}", nonce.hex() + ":" + proof(secret, "rank", str(rank), nonce).hex())


def holds_same_secret(store, rank: int, secret: bytes) -> bool:
    """Whether rank `rank`'s introduction (there already) was made with `secret`."""
    try:
        nonce_hex, proof_hex = store.get(f"rank{rank}").decode().split(":")
        return proves(secret, bytes.fromhex(proof_hex), "rank", str(rank), bytes.fromhex(nonce_hex))
    except ValueError:
        return False


def write_private(path: Path, text: str) -> None:
    """Write `text` to `path` readable by its owner only (0600 from the first byte, also over an older file), each
    step inside the folder's descriptor: a link at the folder or at the temp's name is refused, never followed."""
    path = Path(path)
    tmp = f".{path.name}.{os.getpid()}.tmp"
    folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=folder)
        try:
            os.fchmod(fd, 0o600)  # whatever the umask
            os.write(fd, text.encode())
        finally:
            os.close(fd)
        os.rename(tmp, path.name, src_dir_fd=folder, dst_dir_fd=folder)  # replaces a link at `path`, never follows it
    finally:
        os.close(folder)
