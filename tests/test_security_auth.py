"""An authenticated job (issue 27, point 1): another local user replays the Downpour take-over and is refused.

The take-over, as it worked before jobs had a secret: connect to the job's store on loopback (its port is in
`ss`), claim a dead group's next incarnation with shoal's own handshake, pull the live params, push a huge
gradient and send STOP. The attacker runs as `nobody` where the test runs as root (it drops to nobody's uid
before it touches the network), else as a process of this user that was not given the secret (what makes a
process one of the job's is the secret, nothing else). It tries twice: under the keys shoal used before (nothing answers), and under the
job's namespace (as an observer of the cleartext store traffic across hosts would know it) without the secret:
its knock carries no MAC under the secret (issue 37), so the server never hears it (one line in its log) and
applies nothing. The job ends as it would have, and its accuracy is untouched.

Issue 37, point 2: another local user lists the store's keys (torch's `list_keys`), forges every heartbeat,
progress count and handshake word it finds ("7 7") and replays the values it read: the job does not take any of
them as a peer's word, blames nobody, names the failed authentication in its logs and ends as it would have.
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
from typing import Optional

import pytest
import torch.distributed as dist
from fault_runs import LayoutRun as Run, runs, wait_for  # noqa: F401 - the fixture that stops what a failed test left running
from layouts import assert_ran
from test_cli import leftover_processes
from test_stalls import STALL_TIMEOUT

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
port, namespace, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
if not port.isdigit():  # "fd:N": started before the job's store was up, it reads the port from that pipe
    port = os.fdopen(int(port[3:])).readline()
port = int(port)
seconds = lambda s: datetime.timedelta(seconds=s)
said = {}

def wait_for(knocks, timeout, unless):
    """{name: whether its door answered}, once one did or `unless` (store, key) appeared; knocks: {name: (store, key,
    value or None)}, each watched through the same window."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            answered = {name: store.check([key]) and (value is None or store.get(key).decode() == value)
                        for name, (store, key, value) in knocks.items()}
            if any(answered.values()) or unless[0].check([unless[1]]):  # e.g. the server closed: nothing will answer any more
                return answered
        except Exception:  # the job ended: its store with it
            break
        time.sleep(0.05)
    return dict.fromkeys(knocks, False)

def attempt(what, call):
    try:
        call()
        said[what] = "done"
    except Exception as err:
        said[what] = "failed: " + str(err).splitlines()[0][:120]

base = dist.PrefixStore("/shoal/attempt_0", dist.TCPStore("127.0.0.1", port, is_master=False, timeout=seconds(60)))
# 1. shoal's handshake under the keys it used before jobs had a secret
old_door = dist.PrefixStore("shoal/downpour/", base)
old_incarnation = old_door.add("g1/incarnation", 1)
old_door.set(f"s0/g1/i{old_incarnation}/hello", "attacker")
said["old_keys_hold_state"] = old_door.check(["s0/g1/state"])
# 2. under the job's namespace, without its secret
job = dist.PrefixStore(namespace, base)
door = dist.PrefixStore("shoal/downpour", job)  # shoal/downpour/<key>, as the job writes them
incarnation = door.add("g1/incarnation", 1)
nonce = secrets.token_hex(16)
door.set(f"s0/g1/i{incarnation}/hello", nonce)
print("knocked", flush=True)
# both knocks watched from group 1's death (the test kills it now: the server looks for its next incarnation) to the
# job's end
answered = wait_for({"old_keys_accepted": (old_door, f"s0/g1/i{old_incarnation}/accepted", None),
                     "accepted": (door, f"s0/g1/i{incarnation}/accepted", nonce)}, 90, unless=(door, "s0/closed"))
said.update(answered)
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


def test_another_user_cannot_take_over_a_running_downpour_job(blobs_job, tmp_path, runs, attacker, request):
    command, attacker_env = attacker
    secret = secrets.token_hex(32)
    steps = 400  # each worker takes >= 50 ms a step until the attacker is done (SHOAL_SLOW_UNTIL): the job outlasts
    # the attacker's start (beside the job's, it loads torch meanwhile) and its two knocks however loaded the machine
    # is, up to 20 s; group 1 dies once the attacker knocked
    job = blobs_job(train_steps=steps)
    release = tmp_path / "attacker-done"
    run = Run(job, tmp_path, DOWNPOUR, "--set", f"test_freq={steps}",
              env={"SHOAL_SLOW_WORKER": "0:0+0.05", "SHOAL_SLOW_UNTIL": str(release), "SHOAL_JOB_SECRET": secret})
    runs.append(run)
    # the attacker's interpreter starts beside the job's (it loads torch meanwhile); the port reaches it through a pipe
    namespace = auth.namespace(bytes.fromhex(secret))
    port_reader, port_writer = os.pipe()
    to_the_attacker = os.fdopen(port_writer, "w")
    intruder = subprocess.Popen([*command, f"fd:{port_reader}", namespace, str(PARAMS)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=attacker_env, pass_fds=(port_reader,))
    os.close(port_reader)
    request.addfinalizer(lambda: (to_the_attacker.close(), intruder.kill(), intruder.wait()))  # a failed test leaves none waiting
    intruder.stdin.write(ATTACKER)
    intruder.stdin.close()
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
    to_the_attacker.write(f"{port}\n")
    to_the_attacker.close()
    expected_uid = NOBODY[0] if os.geteuid() == 0 else os.getuid()
    assert intruder.stdout.readline().strip() == f"uid {expected_uid}", intruder.stderr.read()
    assert intruder.stdout.readline().strip() == "knocked", intruder.stderr.read()
    os.kill(group1, signal.SIGKILL)  # group 1 dies: the server waits for its next incarnation, which the attacker claimed
    server_log = logs / "rank2.log"
    refused = re.compile(r"a value of key shoal/downpour/s0/g1/i\d+/hello failed authentication: another local user may "
                         r"be writing to this job's store")
    wait_for(lambda: refused.search(server_log.read_text()) or run.proc.poll() is not None, 60,
             "the server never read the attacker's knock")
    release.touch()  # the knock was read (and refused): the job may run to its end at full speed, its store with it
    said = json.loads(intruder.stdout.readline() or "{}")  # (the attacker watches its knocks until the job's end)
    intruder.wait(timeout=60)
    assert said.get("old_keys_accepted") is False and said["old_keys_hold_state"] is False, said
    assert said["accepted"] is False and "pull" not in said, said  # its knock, made without the secret, was never heard
    assert run.wait(timeout=180) == 0, run.stderr()
    server_text = server_log.read_text()
    assert refused.search(server_text), server_text[-3000:]
    assert "sent worker group 1 (restart" not in server_text and not (logs / "rejoins.jsonl").exists()
    summary = assert_ran(run.ws, DOWNPOUR)
    assert summary["status"] == "finished"
    final = [r for r in read_metrics(run.ws / "metrics.jsonl") if r["phase"] == "test"][-1]
    assert final["step"] == steps and final["accuracy"] >= 0.9, final
    assert leftover_processes(tmp_path) == []


# -- the handshake itself ---------------------------------------------------------------------------
def knock_with(server_secret: bytes, stub_secret: bytes, words_secret: Optional[bytes] = None) -> dict[str, object]:
    """A server and a stub meet through a Door on a fresh store, each proving it holds its secret on the channel: what
    each concluded. The door's words (hello, accepted) are signed with `words_secret` (default: the stub's) on both
    sides: a server whose words fail authentication is never heard at all (test_a_knock_unheard_...)."""
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=10))
    words = words_secret or stub_secret
    server, stub = channels.Door("t", store, words), channels.Door("t", store, words)
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


def test_a_knock_or_an_answer_without_the_secret_is_unheard(capfd):
    """The door's words carry MACs (shoal.comm.signed_store): a stub without the secret knocks unheard, and a server
    without it cannot answer a stub that has it."""
    secret = auth.new_secret()
    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=10))
    server, intruder = channels.Door("t", store, secret), channels.Door("t", store, auth.new_secret())
    intruder._store.set("s0/g1/i0/hello", "a nonce")
    assert server.hello(0, 1, 0) is None
    stub = channels.Door("t", store, secret)
    answering = threading.Thread(target=lambda: [time.sleep(0.2), intruder.accept(0, 1, 1, intruder.hello(0, 1, 1) or "x")])
    answering.start()
    with pytest.raises(RuntimeError, match="server 0 did not answer worker group 1 within 1 s"):
        stub.knock(0, 1, 1, timeout_s=1)
    answering.join()
    err = capfd.readouterr().err
    assert "a value of key shoal/t/s0/g1/i0/hello failed authentication" in err, err
    assert "a value of key shoal/t/s0/g1/i1/hello failed authentication" in err, err  # what the intruder read of the stub's
    assert "a value of key shoal/t/s0/g1/i1/accepted failed authentication" in err, err


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


# -- issue 37, point 2: forged and replayed store values --------------------------------------------
FORGER = r'''
import datetime, json, os, sys, time
import torch.distributed as dist
if os.environ.get("ATTACK_AS"):
    uid, gid = map(int, os.environ["ATTACK_AS"].split(":"))
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
print(f"uid {os.getuid()}", flush=True)
port, watch_s, replay_s, forge_s = int(sys.argv[1]), *map(float, sys.argv[2:5])
store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))
SHOALS = ("shoal/heartbeat/", "shoal/calls/", "shoal/published/", "shoal/downpour/")

def targets():  # shoal's values; not the store's add() counters, nor torch's own keys
    return [k for k in store.list_keys() if any(m in k for m in SHOALS) and not k.endswith("/incarnation")]

while sum("shoal/heartbeat/" in k for k in targets()) < 3:  # the job's processes beat: it trains
    time.sleep(0.05)
seen, said = {}, {"replayed": 0, "forged": 0}
end = time.monotonic() + watch_s  # 1. read the job's values for a while, keeping each one it saw
while time.monotonic() < end:
    for key in targets():
        value = store.get(key)
        if not seen.get(key) or seen[key][-1] != value:
            seen.setdefault(key, []).append(value)
    time.sleep(0.05)
said["keys"] = sorted(seen)
end = time.monotonic() + replay_s  # 2. write back the oldest of them, over and over
while time.monotonic() < end:
    for key, values in seen.items():
        store.set(key, values[0])
        said["replayed"] += 1
    time.sleep(0.003)
print("forging", flush=True)
keys = targets()
for key in keys:  # 3. one oversized value each, then "7 7" everywhere, as fast as the store takes it
    store.set(key, b"x" * 100000)
end, listed = time.monotonic() + forge_s, time.monotonic()
while time.monotonic() < end:
    if time.monotonic() - listed > 0.5:
        keys, listed = targets(), time.monotonic()
    for key in keys:
        store.set(key, "7 7")
        said["forged"] += 1
    time.sleep(0.002)
print(json.dumps(said), flush=True)
'''


@pytest.mark.slow  # 17 s: the attack must outlast the stall timeout (3 s) while the job trains; test_signed_store.py's
# test_a_forged_heartbeat_is_no_beat_and_no_blame checks the same watch in the default suite
def test_forged_and_replayed_store_values_are_ignored_and_blame_nobody(blobs_job, tmp_path, runs, attacker):
    """Another local user lists the running Downpour job's keys, replays the values it read, then writes "7 7" over
    every heartbeat, progress count and handshake word, longer than the stall timeout: before the values carried
    MACs, a healthy process was named as stalled with the attacker's step and the job killed."""
    command, attacker_env = attacker
    steps = 500  # group 0's worker takes >= 20 ms a step (10 s): the attack (about 7 s from the first beats) ends first
    run = Run(blobs_job(train_steps=steps), tmp_path, DOWNPOUR, "--set", f"test_freq={steps}",
              env={"SHOAL_SLOW_WORKER": "0:0+0.02"})
    runs.append(run)
    logs = run.ws / "logs"
    wait_for_file = time.monotonic() + 60
    while not (logs / "store.json").exists():  # where the store is: written before the processes start
        assert time.monotonic() < wait_for_file and run.proc.poll() is None, run.stderr()
        time.sleep(0.05)
    port = json.loads((logs / "store.json").read_text())["port"]
    forge_s = STALL_TIMEOUT + 2.5  # well over the stall timeout (a beat read late): "7 7" made a healthy peer look stalled
    intruder = subprocess.Popen([*command, str(port), "0.8", "0.8", str(forge_s)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=attacker_env)
    intruder.stdin.write(FORGER)
    intruder.stdin.close()
    expected_uid = NOBODY[0] if os.geteuid() == 0 else os.getuid()
    assert intruder.stdout.readline().strip() == f"uid {expected_uid}", intruder.stderr.read()
    assert intruder.stdout.readline().strip() == "forging", intruder.stderr.read()
    said = json.loads(intruder.stdout.readline() or "{}")
    assert intruder.wait(timeout=30) == 0, intruder.stderr.read()
    assert run.proc.poll() is None, "the job ended before the attack did: give it more steps"
    heartbeats = [k for k in said["keys"] if "shoal/heartbeat/" in k]
    assert len(heartbeats) == 3 and any("shoal/downpour/" in k for k in said["keys"]), said["keys"]
    assert said["replayed"] > 0 and said["forged"] > 0, said

    assert run.wait(timeout=180) == 0, run.stderr()
    texts = {"stderr": run.stderr(), **{p.name: p.read_text() for p in logs.glob("rank*.log")}}
    for where, text in texts.items():  # nobody blamed, nothing dropped
        for blame in ("stopped answering", "drops worker group", "dropped", "lost worker group", "Traceback"):
            assert blame not in text, (where, text[-3000:])
        for key in set(re.findall(r"a value of key (\S+) failed authentication", text)):  # named once per key
            assert text.count(f"a value of key {key} failed authentication") == 1, (where, key)
    named = re.findall(r"a value of key shoal/heartbeat/\d failed authentication: another local user may be writing to "
                       r"this job's store", "".join(texts.values()))
    assert len(named) >= 3, texts  # every process reads its peers' heartbeats
    summary = assert_ran(run.ws, DOWNPOUR)
    assert summary["status"] == "finished" and not summary.get("failed_groups"), summary
    final = [r for r in read_metrics(run.ws / "metrics.jsonl") if r["phase"] == "test"][-1]
    assert final["step"] == steps and final["accuracy"] >= 0.9, final
    assert leftover_processes(tmp_path) == []
