"""An authenticated job (issue 27, point 1): another local user replays the Downpour take-over and is refused.

The take-over, as it worked before jobs had a secret: connect to the job's store on loopback (its port is in
`ss`), claim a dead group's next incarnation with shoal's own handshake, pull the live params, push a huge
gradient and send STOP. The attacker runs as `nobody` where the test runs as root (it drops to nobody's uid
before it touches the network), else as a process of this user that was not given the secret (what makes a
process one of the job's is the secret, nothing else). It tries twice: under the keys shoal used before (nothing answers), and under the
job's namespace (as an observer of the cleartext store traffic across hosts would know it) without the secret:
the server opens a channel, the attacker cannot prove it holds the secret, the server refuses it in one line and
applies nothing. The job ends as it would have, and its accuracy is untouched.
"""
from __future__ import annotations

import datetime
import json
import os
import re
import secrets
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from layouts import assert_ran
from test_cli import leftover_processes
from test_stalls import Run, runs  # noqa: F401 - the fixture that stops what a failed test left running

from shoal.comm import auth, channels
from shoal.comm.dist import free_port
from shoal.report.metrics import read_metrics

DOWNPOUR = "Downpour, 2 groups + 1 server, 3 processes"
PARAMS = 16 * 32 + 32 + 32 * 4 + 4  # the blobs MLP's params, all on the one server

ATTACKER = r'''
import datetime, json, os, secrets, sys, time
import torch, torch.distributed as dist
if os.environ.get("ATTACK_AS"):  # another local user: drop to that uid once the interpreter and torch are loaded
    uid, gid = map(int, os.environ["ATTACK_AS"].split(":"))
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
print(f"uid {os.getuid()}", flush=True)
port, namespace, size = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
seconds = lambda s: datetime.timedelta(seconds=s)
said = {}

def wait_for(store, key, value, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if store.check([key]) and (value is None or store.get(key).decode() == value):
            return True
        time.sleep(0.05)
    return False

def attempt(what, call):
    try:
        call()
        said[what] = "done"
    except Exception as err:
        said[what] = "failed: " + str(err).splitlines()[0][:120]

base = dist.PrefixStore("/shoal/attempt_0", dist.TCPStore("127.0.0.1", port, is_master=False, timeout=seconds(60)))
# 1. shoal's handshake under the keys it used before jobs had a secret
door = dist.PrefixStore("shoal/downpour/", base)
incarnation = door.add("g1/incarnation", 1)
door.set(f"s0/g1/i{incarnation}/hello", "attacker")
said["old_keys_accepted"] = wait_for(door, f"s0/g1/i{incarnation}/accepted", None, 3)
said["old_keys_hold_state"] = door.check(["s0/g1/state"])
# 2. under the job's namespace, without its secret
job = dist.PrefixStore(namespace, base)
door = dist.PrefixStore("shoal/downpour/", job)
incarnation = door.add("g1/incarnation", 1)
nonce = secrets.token_hex(16)
door.set(f"s0/g1/i{incarnation}/hello", nonce)
print("knocked", flush=True)
said["accepted"] = wait_for(door, f"s0/g1/i{incarnation}/accepted", nonce, 90)
if said["accepted"]:
    name = f"downpour/s0/g1/i{incarnation}/{nonce}"
    group = dist.ProcessGroupGloo(dist.PrefixStore(f"shoal/channel/{name}", job.clone()), 1, 2, seconds(30))
    send = lambda t, tag: group.send([t], 0, tag).wait()
    def handshake():  # a nonce, then a proof made up without the secret
        pending = group.recv([torch.zeros(32, dtype=torch.uint8)], 0, 91)
        send(torch.ones(32, dtype=torch.uint8), 91)
        pending.wait()
        pending = group.recv([torch.zeros(32, dtype=torch.uint8)], 0, 92)
        send(torch.full((32,), 7, dtype=torch.uint8), 92)
        pending.wait()
    attempt("handshake", handshake)
    values = torch.zeros(size)
    def pull():
        send(torch.tensor([5, 0, 0]), 11)
        group.recv([values], 0, 13).wait()
    attempt("pull", pull)
    said["pulled_nonzero"] = bool(values.abs().sum() > 0)
    def push():
        send(torch.tensor([1, 0, 0]), 11)
        send(torch.full((size,), 1e30), 12)
        send(torch.ones(1, dtype=torch.uint8), 16)
    attempt("push", push)
    attempt("stop", lambda: send(torch.tensor([2, 0, 0]), 11))
print(json.dumps(said), flush=True)
'''


NOBODY = (65534, 65534)


@pytest.fixture
def attacker():
    """The attacker's command (its script read from stdin) and environment, never the job's secret: as `nobody` where
    the test runs as root (the interpreter, under root's 0700 home, starts as root and drops to nobody before it
    touches the network), else as a process of this user that was not given the secret."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_JOB_SECRET")}
    if os.geteuid() == 0:
        env["ATTACK_AS"] = "%d:%d" % NOBODY
    return [sys.executable, "-"], env


def test_another_user_cannot_take_over_a_running_downpour_job(blobs_job, tmp_path, runs, attacker):
    command, attacker_env = attacker
    secret = secrets.token_hex(32)
    job = blobs_job(train_steps=500)
    run = Run(job, tmp_path, DOWNPOUR, "--set", "test_freq=500",
              env={"SHOAL_SLOW_WORKER": "0:0+0.02", "SHOAL_JOB_SECRET": secret})
    runs.append(run)
    group1 = run.pid_of(1)
    logs = run.ws / "logs"
    for name in ("store.json", "job.secret"):  # what reveals the store's port or the secret: this user's only
        assert stat.S_IMODE((logs / name).stat().st_mode) == 0o600, name
    assert (logs / "job.secret").read_text().strip() == secret
    port = json.loads((logs / "store.json").read_text())["port"]
    for proc in Path("/proc").glob("[0-9]*/cmdline"):  # never on a command line, which every user can read
        try:
            assert secret.encode() not in proc.read_bytes(), proc
        except OSError:
            pass
    namespace = auth.namespace(bytes.fromhex(secret))
    intruder = subprocess.Popen([*command, str(port), namespace, str(PARAMS)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=attacker_env)
    intruder.stdin.write(ATTACKER)
    intruder.stdin.close()
    expected_uid = NOBODY[0] if os.geteuid() == 0 else os.getuid()
    assert intruder.stdout.readline().strip() == f"uid {expected_uid}", intruder.stderr.read()
    assert intruder.stdout.readline().strip() == "knocked", intruder.stderr.read()
    os.kill(group1, signal.SIGKILL)  # group 1 dies: the server waits for its next incarnation, which the attacker claimed
    said = json.loads(intruder.stdout.readline() or "{}")
    intruder.wait(timeout=60)
    assert said.get("old_keys_accepted") is False and said["old_keys_hold_state"] is False, said
    assert said["accepted"] is True and not said["pulled_nonzero"], said  # the server opened a channel: nothing came of it
    assert said["pull"].startswith("failed"), said
    assert run.wait(timeout=180) == 0, run.stderr()
    server_log = (logs / "rank2.log").read_text()
    assert re.search(r"refused a process knocking as worker group 1 \(restart \d+\): (it could not prove it holds the job's "
                     r"secret|its handshake failed: .*); nothing it sends is applied", server_log), server_log[-3000:]
    assert "sent worker group 1 (restart" not in server_log and not (logs / "rejoins.jsonl").exists()
    summary = assert_ran(run.ws, DOWNPOUR)
    assert summary["status"] == "finished"
    final = [r for r in read_metrics(run.ws / "metrics.jsonl") if r["phase"] == "test"][-1]
    assert final["step"] == 500 and final["accuracy"] >= 0.9, final
    assert leftover_processes(tmp_path) == []


# -- the handshake itself ---------------------------------------------------------------------------
def knock_with(server_secret: bytes, stub_secret: bytes) -> dict[str, object]:
    """A server and a stub meet through a Door on a fresh store, each with its secret: what each concluded."""
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=10))
    server, stub = channels.Door("t", store, server_secret), channels.Door("t", store, stub_secret)
    concluded: dict[str, object] = {}

    def serve():
        while (nonce := server.hello(0, 1, 0)) is None:
            time.sleep(0.01)
        name = server.accept(0, 1, 0, nonce)
        concluded["server"] = channels.authenticate(server.open(name, 0), name, 0, server_secret)

    serving = threading.Thread(target=serve)
    serving.start()
    try:
        concluded["stub"] = stub.knock(0, 1, 0, timeout_s=10) is not None
    except channels.ImpostorServer as err:
        concluded["stub"] = str(err)
    serving.join(timeout=30)
    return concluded


def test_the_handshake_accepts_the_same_secret_and_refuses_another():
    secret = auth.new_secret()
    assert knock_with(secret, secret) == {"server": True, "stub": True}
    refused = knock_with(secret, auth.new_secret())
    assert refused["server"] is False
    assert refused["stub"] == ("worker group 1: the process serving as server 0 could not prove it holds the job's secret; "
                               "nothing was sent to it")


def test_a_proof_binds_the_role_the_channel_and_both_nonces():
    secret, a, b = auth.new_secret(), os.urandom(32), os.urandom(32)
    made = auth.proof(secret, "stub", "downpour/s0/g1/i1/x", a, b)
    assert auth.proves(secret, made, "stub", "downpour/s0/g1/i1/x", a, b)
    assert not auth.proves(secret, made, "server", "downpour/s0/g1/i1/x", a, b)  # a stub's proof is no server's
    assert not auth.proves(secret, made, "stub", "downpour/s0/g1/i2/x", a, b)
    assert not auth.proves(secret, made, "stub", "downpour/s0/g1/i1/x", b, a)
    assert not auth.proves(auth.new_secret(), made, "stub", "downpour/s0/g1/i1/x", a, b)
    assert auth.namespace(secret) != auth.namespace(auth.new_secret()) and secret.hex()[:16] not in auth.namespace(secret)


def test_ranks_tell_whether_they_hold_the_same_secret():
    store = dist.HashStore()
    secret = auth.new_secret()
    auth.introduce(store, 0, secret)
    assert auth.holds_same_secret(store, 0, secret)
    assert not auth.holds_same_secret(store, 0, auth.new_secret())
    store.set("rank1", "garbage")
    assert not auth.holds_same_secret(store, 1, secret)


# -- where the secret comes from ---------------------------------------------------------------------
def test_secrets_given_by_the_user_are_checked_in_one_line(tmp_path):
    good = secrets.token_hex(32)
    assert auth.given_secret({"SHOAL_JOB_SECRET": good}) == bytes.fromhex(good)
    assert auth.given_secret({}) is None
    for value, says in [("abcd", "has 4 hex digits; at least 32"), ("zz" * 20, "must be hex digits")]:
        with pytest.raises(auth.SecretError, match=says):
            auth.given_secret({"SHOAL_JOB_SECRET": value})
    with pytest.raises(auth.SecretError, match="needs the job's secret on every node: set SHOAL_JOB_SECRET"):
        auth.required_secret("a job over 2 nodes", {})
    path = tmp_path / "secret"
    path.write_text(good + "\n")
    path.chmod(0o644)
    with pytest.raises(auth.SecretError, match=r"may be read by others \(mode 644\); chmod 600 it"):
        auth.given_secret({"SHOAL_JOB_SECRET_FILE": str(path)})
    path.chmod(0o600)
    assert auth.given_secret({"SHOAL_JOB_SECRET_FILE": str(path)}) == bytes.fromhex(good)
    with pytest.raises(auth.SecretError, match="cannot read the job secret"):
        auth.given_secret({"SHOAL_JOB_SECRET_FILE": str(tmp_path / "missing")})


def test_private_files_are_0600_from_the_start_and_replace_an_open_one(tmp_path):
    path = tmp_path / "store.json"
    path.write_text("old")
    path.chmod(0o644)
    old = os.umask(0)  # whatever the umask says
    try:
        auth.write_private(path, "{}\n")
    finally:
        os.umask(old)
    assert path.read_text() == "{}\n" and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store.json"]
