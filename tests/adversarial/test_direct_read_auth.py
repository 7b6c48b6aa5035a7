"""Read plans only where Redis enforces them, from a secret nobody can guess (issue 25, item 6).

A read plan hands a trainer a Redis user that can read only its namespace.  That
means nothing when Redis's ``default`` user admits clients with no password: anyone
who reaches the Redis port reads every tenant.  And the reader passwords are
HMAC-SHA256(secret, namespace): a guessable secret, recovered offline from one
plan, yields every tenant's password.  Checked against real redis-server processes
and the real service.
"""

from __future__ import annotations

import hmac
import secrets
from pathlib import Path

import pytest
import redis

from cache_service.redis_proc import RedisProcess, free_port, start_cluster
from r3_client import DirectReader
from tests.support.frames import TRAJ, frame_for, rid
from tests.support.service_process import KEY_A, KEY_B, Service, start_service

SECRET = secrets.token_urlsafe(32)
DIRECT = {"R3_CACHE_DIRECT_READS": "true", "R3_CACHE_DIRECT_READ_SECRET": SECRET}
#: What an attacker tries first; the weak secret below is one of them.
WORDLIST = ("password", "password1", "secret", "letmein", "password12345678", "qwertyuiop")


def _put(svc: Service, key: str, r: str) -> None:
    with svc.http(key=key) as c:
        resp = c.put(f"/v1/rollouts/{r}/segments", content=frame_for(TRAJ[:20], 0, digest=False))
        assert resp.status_code == 201, resp.text


def _plan(svc: Service, key: str = KEY_A) -> dict[str, object]:
    with svc.http(key=key) as c:
        resp = c.post("/v1/read-plan")
    assert resp.status_code == 200, resp.text
    plan: dict[str, object] = resp.json()
    return plan


def _anonymous_reads(url: str, victim_key: str) -> dict[str, object]:
    """What a client with no credentials at all gets from the Redis at ``url``: the
    other tenant's rollout, every key, and where Redis keeps its files."""
    anon = redis.Redis.from_url(url, socket_timeout=5)
    try:
        return {
            "HGETALL": sorted(anon.hgetall(victim_key)),
            "KEYS *": len(anon.keys("*")),
            "CONFIG GET dir": anon.config_get("dir"),
        }
    finally:
        anon.close()


def _refused_to_anyone(url: str, victim_key: str) -> None:
    anon = redis.Redis.from_url(url, socket_timeout=5)
    try:
        for attempt in (
            lambda: anon.hgetall(victim_key),
            lambda: anon.keys("*"),
            lambda: anon.config_get("dir"),
        ):
            with pytest.raises(redis.exceptions.AuthenticationError, match=r"NOAUTH|authenticated"):
                attempt()
    finally:
        anon.close()


def _locked(proc: RedisProcess) -> str:
    """Give ``proc``'s default user a password; the URL that carries it."""
    password = secrets.token_urlsafe(24)
    with redis.Redis(port=proc.port) as admin:
        admin.config_set("requirepass", password)
    return f"redis://:{password}@127.0.0.1:{proc.port}/0"


def test_direct_reads_refuse_a_redis_that_admits_anyone(tmp_path: Path) -> None:
    """Before: with direct reads on over a Redis whose default user has no password, the
    service started and issued plans, and a client with no credentials read every tenant."""
    open_redis = RedisProcess(free_port(), tmp_path / "redis", appendonly=False).start()
    try:
        try:
            svc = start_service(tmp_path, open_redis.url, env=DIRECT)
        except RuntimeError as exc:
            refusal = str(exc)
        else:
            try:
                theirs = rid()
                _put(svc, KEY_B, theirs)
                plan = _plan(svc)
                leaked = _anonymous_reads(str(plan["redis_url"]), f"r3:tenant-b:{{{theirs}}}")
            finally:
                svc.stop()
            pytest.fail(
                "the service started with direct reads over a Redis that admits anyone and "
                f"issued a plan; a client with no credentials read: {leaked}"
            )
    finally:
        open_redis.stop()
    assert "r3 serve: error:" in refusal, refusal
    assert "default" in refusal and "without a password" in refusal, refusal
    assert "requirepass" in refusal and "R3_CACHE_DIRECT_READS" in refusal, refusal
    assert "Traceback" not in refusal, refusal


@pytest.mark.cluster
def test_direct_reads_refuse_a_cluster_that_admits_anyone(tmp_path: Path) -> None:
    """ACLs are per node: every node of a cluster is checked, and the open ones named."""
    nodes = start_cluster(tmp_path / "cluster")
    try:
        with pytest.raises(RuntimeError, match="without a password") as info:
            start_service(tmp_path, nodes[0].url, cluster=True, env=DIRECT).stop()
    finally:
        for n in nodes:
            n.stop()
    for n in nodes:
        assert f"127.0.0.1:{n.port}" in str(info.value)


def test_embedded_redis_refuses_clients_without_credentials(tmp_path: Path) -> None:
    """Before: the embedded redis-server had no password, so with direct reads on the
    plan's Redis URL alone let anyone read every tenant (the issue's reproduction)."""
    svc = start_service(tmp_path, None, env=DIRECT)
    try:
        mine, theirs = rid(), rid()
        _put(svc, KEY_A, mine)
        _put(svc, KEY_B, theirs)
        plan = _plan(svc)
        assert "@" not in str(plan["redis_url"])  # never the service's own credentials
        with DirectReader(plan) as reader:  # plans still work
            assert dict(reader.get_many([mine]))[mine].end == 20  # type: ignore[union-attr]
        victim = f"r3:tenant-b:{{{theirs}}}"
        try:
            _refused_to_anyone(str(plan["redis_url"]), victim)
        except pytest.fail.Exception:
            leaked = _anonymous_reads(str(plan["redis_url"]), victim)
            pytest.fail(f"the embedded Redis admits anyone; with no credentials: {leaked}")
    finally:
        svc.stop()


def test_no_plan_once_redis_admits_anyone_again(tmp_path: Path) -> None:
    """A Redis that enforced passwords at start-up can stop (a password set at run time is
    lost on restart): plans are refused from then on, not only at start-up."""
    proc = RedisProcess(free_port(), tmp_path / "redis", appendonly=False).start()
    try:
        url = _locked(proc)
        svc = start_service(tmp_path, url, env=DIRECT)
        try:
            _plan(svc)
            with redis.Redis.from_url(url) as admin:
                admin.config_set("requirepass", "")
            with svc.http() as c:
                resp = c.post("/v1/read-plan")
            assert resp.status_code == 503, resp.text
            assert "without a password" in resp.json()["error"]["message"]
        finally:
            svc.stop()
    finally:
        proc.stop()


def _recover(plan: dict[str, object], namespace: str) -> str | None:
    """The secret behind ``plan``'s password, if it is a word an attacker tries."""
    for word in WORDLIST:
        if hmac.new(word.encode(), namespace.encode(), "sha256").hexdigest() == plan["password"]:
            return word
    return None


@pytest.mark.parametrize(
    "weak",
    [
        "password12345678",  # 16 characters, from a wordlist
        "direct-read-secret-direct-read-secret",  # long, but a phrase said twice
        "dev-direct-read-secret-not-secret",  # 33 characters, deploy/'s dev one until now
    ],
    ids=["dictionary-16", "repeated-37", "words-33"],
)
@pytest.mark.parametrize("source", ["env", "file"])
def test_a_guessable_secret_refuses_to_start(tmp_path: Path, weak: str, source: str) -> None:
    """Before: a 16-character dictionary secret was accepted; one plan gave it away
    offline, and with it every tenant's reader password."""
    env = {"R3_CACHE_DIRECT_READS": "true", "R3_CACHE_DIRECT_READ_SECRET": weak}
    if source == "file":
        path = tmp_path / "direct-read-secret"
        path.write_text(weak + "\n")
        env = {"R3_CACHE_DIRECT_READS": "true", "R3_CACHE_DIRECT_READ_SECRET_FILE": str(path)}
    proc = RedisProcess(free_port(), tmp_path / "redis", appendonly=False).start()
    try:
        url = _locked(proc)
        try:
            svc = start_service(tmp_path, url, env=env)
        except RuntimeError as exc:
            refusal = str(exc)
        else:
            try:
                theirs = rid()
                _put(svc, KEY_B, theirs)
                found = _recover(_plan(svc), "tenant-a")
            finally:
                svc.stop()
            pytest.fail(
                f"the service started with the secret {weak!r}"
                + (f", recovered offline from one plan: {found!r}" if found else "")
            )
    finally:
        proc.stop()
    assert "r3 serve: error:" in refusal and "Traceback" not in refusal, refusal
    assert "DIRECT_READ_SECRET" in refusal and "token_urlsafe(32)" in refusal, refusal
    assert weak not in refusal, "the secret is never echoed"
