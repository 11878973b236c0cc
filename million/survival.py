"""What keeps the ranks of a run together when something goes wrong: the log, signals, the watchdog, errors.

- Log: rank 0's lines to stdout and out_dir/train.log, one write per line, surviving a closed pipe.
- on_rank0: work done by rank 0 alone, whose error stops every rank (parallel.all_ok), said once.
- StopRequest: SIGTERM, SIGINT, SIGUSR1 and SIGHUP end the run at the next step boundary, with a checkpoint.
- Watchdog: no rank waits forever for a peer that died or froze.
- stop_on_error: the one line a rank prints for an error, then an exit that waits for nobody.

    python -m pytest tests/test_survival.py tests/e2e/test_long_runs.py -q
"""
import contextlib
import json
import os
import signal
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist

import parallel
from million import rundir

EXIT_PREEMPTED = 75  # a signal asked the run to stop; it saved a checkpoint: relaunch the same command to continue

# A rank that leaves rank 0 to say an error they share waits this long before it exits: torchrun ends the other
# workers as soon as one exits, and rank 0 could be stopped before it printed the line.
QUIET_EXIT_S = 3.0


def write_line(stream, line: str) -> bool:
    """One line in one write (ranks share the launcher's streams: separate writes let two ranks' lines run
    together). If the reader went away (a closed pipe, a killed `tee`), the stream is pointed at /dev/null so
    that no later write, nor Python's flush at exit, fails again; the run goes on. -> whether it was written."""
    try:
        stream.write(line.replace("\n", " ") + "\n")
        stream.flush()
        return True
    except (OSError, ValueError):
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())
        return False


class Log:
    """What a rank says. Rank 0's lines go to stdout and to out_dir/train.log (appended, a whole line at a time),
    so that the run's record survives a lost terminal or a dead pipe. Lines said before the run is known to start
    are held and written when open() is called, so a start that fails leaves no file behind. Errors (any rank) go
    to stderr, and rank 0's to train.log too if it has room. A line train.log cannot take stops the run."""

    def __init__(self, rank: int):
        self.rank, self.fh, self.held = rank, None, []

    def __call__(self, line: str):
        if self.rank == 0:
            self._keep(line)
            write_line(sys.stdout, line)

    def error(self, line: str):
        if self.rank == 0:
            with contextlib.suppress(OSError):  # a full disk: the line is on stderr all the same
                self._keep(line)
        write_line(sys.stderr, line)
        tell_launcher(line)

    def _keep(self, line: str):
        if self.fh is None:
            self.held.append(line)
        else:
            self.fh.write(line.replace("\n", " ") + "\n")

    def open(self, path: str):
        if self.rank == 0 and self.fh is None:
            self.fh = rundir.LineFile(path)
            for line in self.held:
                self.fh.write(line.replace("\n", " ") + "\n")
            self.held = []


def tell_launcher(line: str):
    """The error line also goes to the file torchrun gives each worker (TORCHELASTIC_ERROR_FILE): the summary
    torchrun prints after a failed run then names it as the root cause, instead of a link to torch's docs. In the
    layout torch's own @record writes (less the traceback), so that torchrun reads it without a warning."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        with contextlib.suppress(OSError), open(path, "w") as f:
            json.dump({"message": {"message": line, "extraInfo": {"timestamp": str(int(time.time()))}}}, f)


class SharedError(SystemExit):
    """An error every rank raises together with the same cause (found by rank 0 in on_rank0, or by every rank
    from the same all-reduced numbers): rank 0 alone prints it."""


def on_rank0(fn, device):
    """fn() on rank 0 alone -> its value there, None on the other ranks (from_rank0 shares it). An error in fn
    stops every rank together (parallel.all_ok), instead of leaving the others waiting in the next collective."""
    value, error = None, None
    if dist.get_rank() == 0:
        try:
            value = fn()
        except SystemExit as e:  # a message of ours, already worded for the user
            error = str(e.code)
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        if error is not None and not error.startswith("error"):
            error = f"error (on rank 0): {error}"
    parallel.all_ok(error, "the work of rank 0", device, exc=SharedError)
    return value


def from_rank0(value):
    """Rank 0's value (any picklable object) on every rank."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class StopRequest:
    """SIGTERM, SIGINT, SIGUSR1 (what schedulers send before preemption) and SIGHUP (a lost terminal) only set a
    flag: the step in flight finishes, and at its end all ranks agree to save and exit. A second SIGINT stops at
    once. A worker whose launcher (torchrun) died stops the same way instead of training on as an orphan. The
    reasons are numbered (code, 1 + its place in REASONS) so that one collective tells every rank one of them."""
    REASONS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGHUP", "the launcher (torchrun) died")

    def __init__(self):
        self.signal = None
        self.parent = os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else None
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        if self.signal == "SIGINT" and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal = signal.Signals(signum).name

    def reason(self) -> str | None:
        if self.signal:
            return self.signal
        if self.parent is not None and os.getppid() != self.parent:
            return self.REASONS[-1]
        return None

    def code(self) -> int:
        """0, or 1 + the reason's place in REASONS."""
        reason = self.reason()
        return self.REASONS.index(reason) + 1 if reason else 0


class Watchdog:
    """No rank waits forever for a peer that is gone. A collective whose peer died or froze would wait for
    --dist_timeout_min (NCCL's own watchdog) while holding the GPU; torchrun ends the others only when a worker
    exits. So a thread on every rank bumps a counter in the rendezvous store every `every_s` seconds and reads
    its peers'; a rank that stops with an error posts it there first. A rank whose peer posted an error and has
    not ended by itself `grace_s` later, or whose peer's counter has not moved for `stale_s` (the process died or
    froze), says so in one line and exits, from inside a collective if need be. Nothing is lost by that: a save
    needs every rank, so the newest checkpoint is already the last state that can be saved."""

    def __init__(self, store, rank: int, world: int, log, every_s=3.0, stale_s=30.0, grace_s=10.0):
        self.store, self.rank, self.world, self.log = dist.PrefixStore("watchdog/", store), rank, world, log
        self.every_s, self.stale_s, self.grace_s = every_s, stale_s, grace_s
        self.peers = [r for r in range(world) if r != rank]
        self.stop = threading.Event()
        if world > 1:
            threading.Thread(target=self._watch, name="watchdog", daemon=True).start()

    def _watch(self):
        seen = {r: (-1, time.monotonic()) for r in self.peers}  # counter, when it moved
        failed_at = None
        try:
            while not self.stop.wait(self.every_s):
                self.store.add(f"beat/{self.rank}", 1)
                now = time.monotonic()
                if self.store.add("failed", 0):
                    failed_at = failed_at or now
                    if now - failed_at > self.grace_s:
                        return self._end(self.store.get("error").decode())
                for r, (count, moved) in seen.items():
                    if self.store.add(f"done/{r}", 0):
                        continue
                    new = self.store.add(f"beat/{r}", 0)
                    if new != count:
                        seen[r] = (new, now)
                    elif now - moved > self.stale_s:
                        return self._end(f"rank {r} has not answered for {now - moved:.0f} s (it died or hangs)")
        except Exception:  # the store is gone with the launcher: StopRequest notices that at the step's end
            return

    def _end(self, why: str):
        self.log.error(f"error (rank {self.rank}): {why}; ending this rank. Relaunch the same command to continue "
                       "from the newest checkpoint")
        os._exit(1)

    def failed(self, msg: str, said: bool):
        """This rank stops with an error (`said`: it printed it): tell the others, who may be waiting for it in
        a collective."""
        with contextlib.suppress(Exception):
            self.store.set("error", msg)
            if said:
                self.store.add(f"said/{self.rank}", 1)
            self.store.add("failed", 1)

    def finished(self):
        self.stop.set()
        with contextlib.suppress(Exception):
            self.store.add(f"done/{self.rank}", 1)

    def culprit(self) -> str:
        """After a collective failed because a peer went away: which one. A peer that stopped with an error
        posted it before it left; one whose counter stays still for two beats died without a word."""
        try:
            said = [r for r in self.peers if self.store.add(f"said/{r}", 0)]
            if said:
                return f"rank {said[0]} stopped with an error; see its message"
            still = {r: self.store.add(f"beat/{r}", 0) for r in self.peers if not self.store.add(f"done/{r}", 0)}
            deadline = time.monotonic() + 2 * self.every_s + 1
            while still and time.monotonic() < deadline:
                time.sleep(0.5)
                still = {r: n for r, n in still.items() if self.store.add(f"beat/{r}", 0) == n}
        except Exception:  # the store went with the launcher
            still = {}
        if not still:
            return "another rank stopped or hangs"
        ranks = ", ".join(map(str, still))
        return (f"rank{'s' if len(still) > 1 else ''} {ranks} died without a message (killed, or out of host "
                "memory)")


def peer_failure(e: RuntimeError) -> bool:
    """A collective failed because another rank died (gloo: the connection closed) or past the timeout."""
    text = str(e)
    return isinstance(e, dist.DistError) or any(s in text for s in ("Connection closed by peer", "timed out",
                                                                    "Timed out", "Connection reset by peer"))


def error_message(e: BaseException, cfg, cp: int, rank: int, watchdog: Watchdog | None) -> str | None:
    """The one line a rank prints for an error it can explain; None for a bug (which keeps its traceback)."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    if isinstance(e, SystemExit):  # our own messages, already worded for the user
        return str(e.code) if isinstance(e.code, str) else None
    if isinstance(e, (ValueError, OSError)):  # bad input found after start-up (model files, data, disk)
        return f"error (rank {rank}): {type(e).__name__}: {first}"
    if isinstance(e, torch.OutOfMemoryError):
        return (f"error (rank {rank}): out of GPU memory at --seq_len {cfg.seq_len} with --cp {cp} ({first}). Less "
                "memory per GPU: a larger --cp (more GPUs per sequence), --offload true, --tiled_mlp true with a "
                "smaller --mlp_tile, a smaller --loss_chunk, or a shorter --seq_len")
    if isinstance(e, RuntimeError) and peer_failure(e):
        who = watchdog.culprit() if watchdog is not None else "another rank stopped or hangs"
        return (f"error (rank {rank}): {who} ({first[:200]}). A collective waits at most --dist_timeout_min "
                f"{cfg.dist_timeout_min:g}; relaunch the same command to continue from the newest checkpoint")
    return None


def stop_on_error(e: BaseException, cfg, cp: int, rank: int, log: Log, watchdog: Watchdog | None):
    """Say e in one line (a bug: with its traceback; a SharedError: on rank 0 only; a pointer to the rank that
    failed: not at all), tell the peers, and exit."""
    msg = error_message(e, cfg, cp, rank, watchdog)
    quiet = msg is not None and (isinstance(e, SharedError) and rank != 0 or parallel.ELSEWHERE in msg)
    if watchdog is not None:  # the other ranks may be waiting for this one in a collective
        watchdog.failed(msg or f"rank {rank} failed: {type(e).__name__}: {e}", said=not quiet)
    if msg is None:
        log.error(f"error (rank {rank}): {type(e).__name__}: {e}")
        traceback.print_exc()
    elif quiet:
        time.sleep(QUIET_EXIT_S)
    else:
        log.error(msg)
    # Out without tearing the process group down: under NCCL that can wait on a collective that a dead peer
    # never joins. The OS frees the rest.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)
