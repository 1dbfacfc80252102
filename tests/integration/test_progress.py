"""Progress on every long step, read as a user reading a pipe would (trainer.progress).

Each command runs as its own process with stdout and stderr pipes and ``DILOCOX_PROGRESS_EVERY=0``
(every update shown), so the periodic lines of short runs can be read: ``data prepare`` on a small
corpus, a demo run's workers (their logs), the audit's rounds and replay, export; ``plot`` on the
run's rounds.jsonl; ``status --watch`` beside a worker whose two pipeline stages start (alive and
"starting" meanwhile, the start-up and the last stage's inner steps in its log). And the audit's
anvil and temporary directory do not outlive a SIGTERM or a SIGINT.

The same demo run is the replay's matrix (audit.replay_env): under every auditor capability and
thread count, the union of ``--replay 4`` samples of seeds 1..8 replays bit for bit in the workers'
recorded kernels, and within the fallback tolerance in the auditor's own.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch

from cli.cluster import LocalCluster
from proto import WorkerPhase
from tests.conftest import small_config
from trainer.config import ModelConfig, RoundConfig
from trainer.progress import EVERY_ENV

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, EVERY_ENV: "0", "PYTHONUNBUFFERED": "1"}
# <what>: i/N [unit] (x%), <rate>, ETA mm:ss   and the final   ..., done in mm:ss
PERIODIC = r": (\d[\d,.]*(?: [kMG]?B)?)/(\d[\d,.]*(?: [kMG]?B)?)(?: \w+)? \((\d+)%\), .+/s, ETA \d\d:\d\d$"
FINAL = r": .*\(100%\), .+/s, done in \d\d:\d\d$"
DEMO = ["model.family=llama", "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.block_size=32",
        "inner.steps=6", "inner.batch_size=4", "rounds.rounds=2", "data.eval_batches=2"]


def sigint_as_default() -> None:
    """In the child, before exec: SIGINT back to its default, so the test's Ctrl-C reaches the command
    even when the suite itself runs as a background job (a shell starts those with SIGINT ignored,
    and an ignored signal stays ignored across exec)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def dilocox(*args: str, timeout: float = 240, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cli.main", *args], cwd=REPO, stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=timeout, env=env or ENV)


def lines_of(text: str, what: str) -> list[str]:
    """The lines of ``what``'s progress (a log line's prefix is allowed)."""
    return [line for line in text.splitlines() if f"{what}: " in line or line.startswith(what)]


def assert_progress(text: str, what: str, min_periodic: int = 2) -> list[str]:
    """At least ``min_periodic`` periodic lines of ``what``, counting up, then one final line."""
    lines = lines_of(text, what)
    periodic = [line for line in lines if re.search(PERIODIC, line)]
    finals = [line for line in lines if re.search(FINAL, line)]
    assert len(periodic) >= min_periodic and len(finals) == 1, "\n".join(lines) or text[-3000:]
    percents = [int(re.search(PERIODIC, line).group(3)) for line in periodic]
    assert percents == sorted(percents) and percents[-1] == 100, percents
    assert lines[-1] == finals[0], lines[-3:]
    return lines


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished demo run (a local chain, 2 workers, 2 rounds of a tiny Llama), its workers' and
    audit's progress shown at every update."""
    run_dir = tmp_path_factory.mktemp("progress") / "demo"
    done = dilocox("demo", "--run-dir", str(run_dir), *[a for s in DEMO for a in ("--set", s)], timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return run_dir


def test_data_prepare_shows_the_bytes_it_has_read(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for f in range(3):
        (corpus / f"part{f}.txt").write_text("".join(f"document {f}.{d}: " + "words of text " * 2000 + "\n\n"
                                                     for d in range(4)))
    done = dilocox("data", "prepare", str(corpus), "--out", str(tmp_path / "tokens"), "--tokenizer", "bpe",
                   "--vocab-size", "300", "--eval-fraction", "0.2")
    assert done.returncode == 0, done.stderr[-2000:]
    assert_progress(done.stderr, "data prepare: reading for the BPE tokenizer")
    lines = assert_progress(done.stderr, "data prepare: tokenizing")
    assert "336.2 kB/336.2 kB (100%)" in lines[-1] and re.search(r"[kM]B/s", lines[-1])
    assert "data prepare" not in done.stdout and "train on it with" in done.stdout  # stdout: the result only


def test_a_workers_inner_steps_are_in_its_log(demo_run: Path) -> None:
    log = (demo_run / "logs" / "worker-0.log").read_text(errors="replace")
    for r in (1, 2):
        lines = assert_progress(log, f"round {r} inner steps", min_periodic=6)
        assert all("tokens/s" in line and " steps (" in line for line in lines)
        assert all(" INFO dilocox.progress: " in line for line in lines)  # through logging
    assert not lines_of(log, "starting 1 pipeline stages")  # one stage: no stage processes to start


def test_the_audits_rounds_and_replay_show_progress_piped(demo_run: Path) -> None:
    done = dilocox("audit", "--run", str(demo_run), "--allow-dev", "--replay", "2", "--replay-seed", "3")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "AUDIT PASSED" in done.stdout
    assert_progress(done.stderr, "audit: rounds checked and checkpoints re-derived", min_periodic=2)
    lines = assert_progress(done.stderr, "audit replay (2 sampled", min_periodic=6)
    assert all("tokens/s" in line for line in lines)
    assert_progress(done.stderr, "audit re-scoring held-out loss", min_periodic=1)
    assert "audit" not in " ".join(re.findall(r"^audit.*$", done.stdout, re.M))  # no progress on stdout


# One process per auditor capability (torch reads it once, at import), for 1 and 2 threads: the union
# of the samples of seeds 1..8, replayed in this process's own kernels with each thread count and,
# with argv[2] "exact", in the workers' kernels (a child process, whose capability and threads are
# the recorded ones whatever the auditor's: replay_env.child_environment, unit-tested); JSON rows.
_REPLAY_MATRIX = """
import json, sys
import torch
from audit.replay import Replayer
from audit.reveal import local_reveal_sources
from trainer.config import RunConfig
from trainer.runstore.run_dir import RunDir
from storage_client import lineage
run = RunDir(sys.argv[1])
manifests = {m.round: m for _, m in lineage(run.store, run.head())}
config = RunConfig.from_json(run.store.get_json(manifests[0].config))
union = set()
for seed in range(1, 9):
    union.update(Replayer(run.store, config, manifests).sample(4, seed)[0])
out = {"union": sorted(union), "kernels": {f"{r}:{p.worker}": str(p.kernels) for r, m in manifests.items()
                                           for p in m.participants}, "runs": []}
for threads, worker_kernels in ((2, True), (1, False), (2, False))[0 if sys.argv[2] == "exact" else 1:]:
    torch.set_num_threads(threads)
    replayer = Replayer(run.store, config, manifests, worker_kernels=worker_kernels,
                        reveal_sources=local_reveal_sources(run.path))  # the demo's workers' retained states
    rows, _ = replayer.replay(sorted(union))
    replayer.close()
    out["runs"].append({"auditor": [torch.backends.cpu.get_cpu_capability(), torch.get_num_threads()],
                        "worker_kernels": worker_kernels, "rows": [row.to_json() for row in rows],
                        "problems": replayer.problems})
print(json.dumps(out))
"""


def test_the_replay_never_accuses_the_honest_on_any_capability_or_thread_count(demo_run: Path) -> None:
    """``--replay 4`` for seeds 1..8 under ATEN_CPU_CAPABILITY default, avx2 and the machine's best,
    with 1 and 2 threads: every contribution sampled is replayed in its worker's recorded kernels
    (a child process, started by the auditor furthest from them: generic kernels, 2 threads) with
    d = 0, and in the auditor's own within the fallback tolerance. Three processes and one child:
    each costs its interpreter and the imports of torch and transformers, most of the test's time."""
    # None: the machine's best, when it is not one of the others already (an AVX2 machine's best is avx2)
    capabilities = (["default"] + (["avx2"] if torch.cpu._is_avx2_supported() else [])
                    + ([None] if torch.cpu._is_avx512_supported() else []))
    seen = []
    for capability in capabilities:
        env = {k: v for k, v in ENV.items() if k not in ("ATEN_CPU_CAPABILITY", "OMP_NUM_THREADS")}
        env.update({"ATEN_CPU_CAPABILITY": capability} if capability else {})
        exact = "exact" if capability == "default" else "own"
        done = subprocess.run([sys.executable, "-c", _REPLAY_MATRIX, str(demo_run), exact], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stderr[-3000:]
        out = json.loads(done.stdout.strip().splitlines()[-1])
        assert len(out["union"]) == len(out["kernels"]) == 4 and "None" not in out["kernels"].values()
        for run in out["runs"]:
            seen.append((*run["auditor"], run["worker_kernels"]))
            assert not run["problems"], run["problems"]
            rows = run["rows"]
            assert sorted([row["round"], row["worker"]] for row in rows) == out["union"]
            assert all(row["status"] == "ok" and row["distance"] <= row["tolerance"] for row in rows), rows
            for row in rows:
                recorded = out["kernels"][f"{row['round']}:{row['worker']}"]
                if run["worker_kernels"]:  # bit for bit, in the kernels the worker recorded
                    assert row["distance"] == 0.0 and row["kernels"] == f"worker's ({recorded})", row
                else:
                    assert row["kernels"].startswith(f"auditor's ({run['auditor'][0].lower()}, "), row
            print(run["auditor"], "worker's" if run["worker_kernels"] else "own",
                  {f"{row['round']}:{row['worker']}": row["distance"] for row in rows})
    assert len(set(seen)) == len(seen) == 2 * len(capabilities) + 1  # each environment took effect
    assert ("DEFAULT", 2, True) in seen


def test_export_shows_its_steps(demo_run: Path, tmp_path: Path) -> None:
    done = dilocox("export", "--run", str(demo_run), "--round", "2", str(tmp_path / "hf"))
    assert done.returncode == 0, done.stderr[-2000:]
    lines = assert_progress(done.stderr, "export of round 2", min_periodic=2)
    assert lines[0].startswith("export of round 2: 1/2 steps (50%)"), lines
    assert (tmp_path / "hf" / "model.safetensors").is_file()


def test_plot_draws_the_rounds_and_names_a_bad_line(demo_run: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    text = (demo_run / "rounds.jsonl").read_text()
    (run / "rounds.jsonl").write_text(text + '{"round": 3, "eval_loss": NaN, "bytes_up": 1}\n' + "[" * 5000 + "\n")
    done = dilocox("plot", "--run", str(run), "--out", str(tmp_path / "rounds.png"))
    assert done.returncode == 0, done.stderr[-2000:]
    png = (tmp_path / "rounds.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 20_000
    assert "wrote" in done.stdout and "(3 rounds" in done.stdout
    assert "rounds.jsonl line 4 skipped: \"bytes_down\" is not a whole number >= 0" in done.stderr
    assert "rounds.jsonl line 5 skipped: the line nests deeper than" in done.stderr
    assert "Traceback" not in done.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    done = dilocox("plot", "--run", str(empty))
    assert done.returncode == 1 and "rounds.jsonl does not exist" in done.stderr and "Traceback" not in done.stderr


def ours(temp: Path) -> list[str]:
    """The audit's temporary directories (its copy of the chain state, anvil's log) in ``temp``."""
    return sorted(p.name for p in temp.iterdir() if p.name.startswith("dilocox-"))


def _anvils_on(port: int) -> list[int]:
    """Pids of anvil processes serving ``port``."""
    out = []
    for entry in Path("/proc").iterdir():
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if args and args[0].endswith(b"anvil") and str(port).encode() in args:
            out.append(int(entry.name))
    return out


@pytest.mark.parametrize("sig, code, said", [
    (signal.SIGTERM, 128 + signal.SIGTERM, "SIGTERM: stopping the local chain"),
    (signal.SIGINT, 130, "interrupted (SIGINT)"),
], ids=["SIGTERM", "SIGINT"])
def test_a_signalled_audit_stops_its_anvil_and_removes_its_temp_dir(demo_run: Path, tmp_path: Path, sig: int,
                                                                     code: int, said: str) -> None:
    temp = tmp_path / "tmp"
    temp.mkdir()
    audit = subprocess.Popen([sys.executable, "-m", "cli.main", "audit", "--run", str(demo_run), "--allow-dev",
                              "--replay", "4"], cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env={**ENV, "TMPDIR": str(temp)},
                             preexec_fn=sigint_as_default)
    try:
        assert audit.stderr is not None
        for line in audit.stderr:  # wait for the replay to be under way: anvil runs, the temp dir exists
            if line.startswith("audit replay ("):
                break
        else:
            pytest.fail(f"the audit ended before its replay began: {audit.wait()}")
        assert ours(temp)
        audit.send_signal(sig)
        out, err = audit.communicate(timeout=60)
    finally:
        if audit.poll() is None:
            audit.kill()
    assert audit.returncode == code, (audit.returncode, err[-2000:])
    assert said in err and "Traceback" not in err, err[-2000:]
    assert "AUDIT PASSED" not in out  # stopped before the verdict
    port = int(re.search(r"local chain http://127\.0\.0\.1:(\d+)", out).group(1))
    assert _anvils_on(port) == []
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    assert ours(temp) == []  # the state copy and anvil's log directory are gone
    assert (demo_run / "chain" / "state.json").is_file()  # the run's own state untouched


def test_status_watch_shows_a_worker_starting_its_stages_as_alive(cluster: LocalCluster, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "config.json"
    small_config(model=ModelConfig(block_size=32, n_layer=2, n_head=2, n_embd=32),
                 rounds=RoundConfig(rounds=1, expected_workers=1, quorum=1, straggler_timeout_s=30.0,
                                    heartbeat_interval_s=0.2, liveness_timeout_s=1.0)).save(config)
    monkeypatch.setenv(EVERY_ENV, "0")  # the cluster's processes inherit it
    cluster.start_coordinator(config)
    cluster.start_worker("w0", extra=["--stages", "2", "--cores", "2"])
    watch = subprocess.Popen([sys.executable, "-m", "cli.main", "status", "--coordinator", str(cluster.address),
                              *cluster.tls_args(), "--watch", "0.2"], cwd=REPO, stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
                             preexec_fn=sigint_as_default)
    try:
        # Liveness lapses 1 s after the last heartbeat; starting the stages takes longer than that.
        status = cluster.wait_for(lambda s: any(w.phase == WorkerPhase.STARTING for w in s.workers), 60,
                                  "w0 to say it is starting")
        coordinator = cluster.processes["coordinator"]
        while status.workers[0].phase == WorkerPhase.STARTING:
            assert status.workers[0].alive, status
            time.sleep(0.2)
            try:
                status = cluster.status()
            except grpc.RpcError:
                # The one-round run can finish, and its coordinator stop listening and exit, between two
                # looks on a busy machine; w0 was alive at every look while it was starting, which is
                # what counts. A coordinator that stopped answering but does not exit fails here.
                assert coordinator.wait(timeout=60) == 0, cluster.log("coordinator")
                break
        assert cluster.wait_exit("w0", 120) == 0, cluster.log("w0")
        watch.send_signal(signal.SIGINT)
        out, err = watch.communicate(timeout=30)
    finally:
        if watch.poll() is None:
            watch.kill()
    assert watch.returncode == 0, err[-2000:]
    assert out.count("--- ") >= 2 and "workers" in out and "starting" in out, out[-3000:]
    log = cluster.log("w0", tail=1000)
    assert_progress(log, "starting 2 pipeline stages", min_periodic=1)
    lines = assert_progress(log, "round 1 inner steps", min_periodic=3)  # from the last stage's process
    assert all("tokens/s" in line for line in lines)


def test_the_run_is_audited_from_its_served_store_alone_and_a_flipped_byte_is_named(
        demo_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """issue 29: ``dilocox store serve`` over HTTPS with the run's certificate, an audit with nothing but
    the chain's RPC, the gateway's URL and the deployment (--replay 2, the states it challenges revealed
    by the workers' retention folders), an independent client
    (multiformats) fetching the HEAD manifest and its checkpoint by CID, a mirror of the run made
    twice (the second fetches nothing), an exported CAR read by ipld-car, and one byte flipped at the
    server named by its CID."""
    import shutil
    import ssl
    import urllib.request

    import ipld_car
    from multiformats import CID as IndependentCID
    from multiformats import multihash

    from cli.main import main as cli_main
    from settlement import Anvil
    from storage_client import Manifest, ObjectStore, lineage

    served = tmp_path / "served"
    shutil.copytree(demo_run / "store", served / "store")  # the flip below must not touch the module's run
    shutil.copyfile(demo_run / "chain" / "state.json", tmp_path / "state.json")
    tls = demo_run / "tls"
    server = subprocess.Popen([sys.executable, "-m", "cli.main", "store", "serve", "--run", str(served), "--port", "0",
                               "--tls", "--tls-cert", str(tls / "cert.pem"), "--tls-key", str(tls / "key.pem")],
                              cwd=REPO, env=ENV, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
    try:
        line = server.stdout.readline()
        url = re.search(r"(https://\S+?)/ipfs/", line).group(1)
        root = (demo_run / "dev-root" / "dev-root.address").read_text().strip()
        chain = json.loads((demo_run / "chain" / "deployment.json").read_text())
        with Anvil(state_file=tmp_path / "state.json", chain_id=chain["chain_id"]) as anvil:
            # The commands run in this process (cli.main), the gateway in its own: an interpreter start
            # with torch costs seconds each.
            remote = ("audit", "--rpc", anvil.rpc_url, "--store", url, "--store-ca", str(tls / "cert.pem"),
                      "--deployment", str(demo_run / "chain" / "deployment.json"), "--allow-dev", "--dev-root", root,
                      *(arg for folder in sorted((demo_run / "retained").iterdir()) for arg in ("--reveal", str(folder))))
            status = cli_main([*remote, "--replay", "2", "--replay-seed", "3"])
            out = capsys.readouterr().out
            assert status == 0 and "AUDIT PASSED" in out, out[-3000:]

            head = (demo_run / "HEAD").read_text().strip()
            context = ssl.create_default_context(cafile=str(tls / "cert.pem"))
            checkpoint = Manifest.from_json(json.loads(ObjectStore(served / "store").get(head))).params
            for cid_text in (head, checkpoint):
                cid = IndependentCID.decode(cid_text)
                request = urllib.request.Request(f"{url}/ipfs/{cid_text}", headers={"Accept": "application/vnd.ipld.raw"})
                with urllib.request.urlopen(request, context=context, timeout=30) as response:
                    body = response.read()
                assert multihash.digest(body, "sha2-256") == bytes(cid.digest), cid_text

            run_id = "0x" + lineage(ObjectStore(served / "store"), head)[0][0].hex  # the genesis manifest's digest
            mirror = ("mirror", "--run-id", run_id, "--from", url, "--store-ca", str(tls / "cert.pem"),
                      "--to", str(tmp_path / "mirror"), "--rpc", anvil.rpc_url,
                      "--deployment", str(demo_run / "chain" / "deployment.json"))
            assert cli_main(list(mirror)) == 0
            assert re.search(r"rounds 0 to 2 .* [1-9]\d* fetched and verified", capsys.readouterr().out)
            assert cli_main(list(mirror)) == 0
            assert re.search(r" 0 fetched and verified, [1-9]\d* reads from the mirror", capsys.readouterr().out)
            assert ObjectStore(tmp_path / "mirror" / "store").get(checkpoint) == ObjectStore(served / "store").get(checkpoint)

            assert cli_main(["export", "--car", "--run", str(demo_run), "--round", "1", str(tmp_path / "r1.car")]) == 0
            assert cli_main(["store", "car", "--run", str(demo_run), "--round", "1", str(tmp_path / "same.car")]) == 0
            assert (tmp_path / "same.car").read_bytes() == (tmp_path / "r1.car").read_bytes()  # one writer, two doors
            roots, blocks = ipld_car.decode((tmp_path / "r1.car").read_bytes())
            assert len(blocks) >= 4 and all(multihash.digest(bytes(d), "sha2-256") == bytes(c.digest) for c, d in blocks)
            assert [r.encode("base32") for r in roots] == [str(lineage(ObjectStore(served / "store"), head)[1][0])]

            flipped = ObjectStore(served / "store").path_of(checkpoint)
            data = bytearray(flipped.read_bytes())
            data[len(data) // 2] ^= 0x01
            flipped.write_bytes(bytes(data))
            status = cli_main(list(remote))
            out = capsys.readouterr().out
            assert status == 1 and "AUDIT FAILED" in out and checkpoint in out.replace("\n", ""), out[-3000:]

            nowhere = [a if a != url else "http://127.0.0.1:9" for a in remote]  # nothing listens on port 9
            assert cli_main(nowhere) == 2
            assert "cannot audit: no source has a correct copy of object" in capsys.readouterr().out.replace("\n", "")
    finally:
        server.terminate()
        assert server.wait(30) == 128 + signal.SIGTERM
