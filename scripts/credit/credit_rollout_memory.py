"""Peak memory and bytes sent and received per rank of ``credit rollout`` at 0.25 degrees, against CREDIT's.

    python scripts/credit/credit_rollout_memory.py [--out FOLDER] [--layouts 1,2,4,2x2] [--steps 2] [--no-credit]

The data and model of ``scripts/credit/credit_train_memory.py`` (721 x 1440, the channels of CREDIT's 0.25-degree
example ``wxformer_era5_025deg_6hr.yml``: 70 input and 64 output channels, 13 levels; a slim CrossFormer, dims
8 to 64, Earth padding to 768 x 1472), a checkpoint in CREDIT's layout
(``mpidomain.credit.reference.credit_checkpoint``) and an inference block: one forecast of ``--steps`` 6-hour
steps from 2001-01-01T00, netCDF, one file per step; ACC against the config's mean file. Then:

- CREDIT's own ``credit rollout`` in one process (CPU, float32, one thread; the config as CREDIT needs it,
  ``mpidomain.credit.reference.credit_rollout_config``): its peak resident memory, measured (this script's
  first child process, ``RUSAGE_CHILDREN``). What it holds is the whole field: its arrays' bytes are the
  accounting of the same shapes (the whole input and prediction), not measured inside CREDIT. One process
  sends nothing; CREDIT's ``ddp`` and ``fsdp`` modes hold the same whole field on every GPU.
- ``mpiexec -n N python -m mpidomain credit rollout`` at each layout, run in process by ``N`` ranks of this
  script (``--worker``), which report from every rank: the peak resident memory (``ru_maxrss``) and the
  resident memory before the rollout (imports, MPI); the largest tensor any torch operation made during the
  rollout (a ``TorchDispatchMode``, which holds no tensor itself); the bytes read from the files; the input and
  prediction a rank holds (its tile's channels, accounting); and the bytes sent and received,
  counted by an MPI profiling layer (``LD_PRELOAD``, compiled here with the MPI's ``mpicc``) on every MPI
  call: point-to-point messages (halo exchanges; the tiles sent to each file's writer), all-to-all (the
  padding's and long-range attention's re-distributions), all-reduce (its buffer once, each way) and the
  other collectives (agreement steps, the scores' sums, broadcasts). Sums over the whole run: setup,
  ``--steps`` steps, the files and the scores.

Prints the table (the largest rank of each layout, and the writer's received bytes) and the commands.
Needs ``mpicc`` beside the Python's ``mpiexec`` (PyPI's ``mpich`` has both) and a C compiler.
"""

import argparse
import ctypes
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import credit_train_memory as train_memory  # noqa: E402  (the data and model of the training table)

GRID = train_memory.GRID
INIT = "2001-01-01T00"
KINDS = ("point-to-point (halos)", "the files' tiles to their writer", "all-to-all", "all-reduce",
         "other collectives")
MiB = 2 ** 20

#: The MPI profiling layer: every rank's bytes sent and received, by kind of call (see the module docstring).
TRAFFIC_C = r"""
#include <mpi.h>
#include <stdlib.h>
enum { P2P, WRITER, ALLTOALL, ALLREDUCE, OTHER, KINDS };
static long long counts[KINDS][3]; /* sent bytes, received bytes, calls */
static int writer_tag = -2;        /* the tag of point-to-point messages counted as WRITER (TRAFFIC_WRITER_TAG) */
void traffic_read(long long *out) { for (int k = 0; k < KINDS; k++) for (int j = 0; j < 3; j++) out[3*k+j] = counts[k][j]; }
void traffic_reset(void) { for (int k = 0; k < KINDS; k++) counts[k][0] = counts[k][1] = counts[k][2] = 0; }
static long long bytes(MPI_Count count, MPI_Datatype type) {
    MPI_Count size = 0;
    if (type != MPI_DATATYPE_NULL) PMPI_Type_size_c(type, &size);
    return (long long)count * (long long)size;
}
static int me(MPI_Comm comm) { int r = -1; PMPI_Comm_rank(comm, &r); return r; }
static int ranks(MPI_Comm comm) { int n = 1; PMPI_Comm_size(comm, &n); return n; }
static void add(int kind, long long out, long long in) { counts[kind][0] += out; counts[kind][1] += in; counts[kind][2]++; }
static int p2p(int tag) {
    if (writer_tag == -2) writer_tag = getenv("TRAFFIC_WRITER_TAG") ? atoi(getenv("TRAFFIC_WRITER_TAG")) : -1;
    return tag == writer_tag ? WRITER : P2P;
}
static void peer(int tag, int other, MPI_Comm comm, long long out, long long in) {
    if (other != MPI_PROC_NULL && other != me(comm)) add(p2p(tag), out, in);  /* messages to itself left out */
}
/* persistent requests (halo plans): their bytes, counted at each start */
#define SLOTS 65536
static MPI_Request handles[SLOTS];
static long long sizes[SLOTS][3];
static int used;
static void remember(MPI_Request request, int tag, int other, MPI_Comm comm, long long out, long long in) {
    if (used < SLOTS && other != MPI_PROC_NULL && other != me(comm)) {
        handles[used] = request; sizes[used][0] = out; sizes[used][1] = in; sizes[used][2] = p2p(tag); used++;
    }
}
static void started(MPI_Request request) {
    for (int i = 0; i < used; i++)
        if (handles[i] == request) { add((int)sizes[i][2], sizes[i][0], sizes[i][1]); return; }
}
static void forget(MPI_Request request) {
    for (int i = 0; i < used; i++) if (handles[i] == request) {
        used--; handles[i] = handles[used];
        for (int j = 0; j < 3; j++) sizes[i][j] = sizes[used][j];
        return;
    }
}
#define SENDS(NAME, COUNT) \
int MPI_##NAME(const void *buf, COUNT count, MPI_Datatype type, int dest, int tag, MPI_Comm comm) { \
    peer(tag, dest, comm, bytes(count, type), 0); return PMPI_##NAME(buf, count, type, dest, tag, comm); }
SENDS(Send, int) SENDS(Send_c, MPI_Count) SENDS(Ssend, int) SENDS(Ssend_c, MPI_Count)
#define ISENDS(NAME, COUNT) \
int MPI_##NAME(const void *buf, COUNT count, MPI_Datatype type, int dest, int tag, MPI_Comm comm, MPI_Request *req) { \
    peer(tag, dest, comm, bytes(count, type), 0); return PMPI_##NAME(buf, count, type, dest, tag, comm, req); }
ISENDS(Isend, int) ISENDS(Isend_c, MPI_Count) ISENDS(Issend, int) ISENDS(Issend_c, MPI_Count)
#define RECVS(NAME, COUNT) \
int MPI_##NAME(void *buf, COUNT count, MPI_Datatype type, int source, int tag, MPI_Comm comm, MPI_Status *status) { \
    peer(tag, source, comm, 0, bytes(count, type)); return PMPI_##NAME(buf, count, type, source, tag, comm, status); }
RECVS(Recv, int) RECVS(Recv_c, MPI_Count)
#define IRECVS(NAME, COUNT) \
int MPI_##NAME(void *buf, COUNT count, MPI_Datatype type, int source, int tag, MPI_Comm comm, MPI_Request *req) { \
    peer(tag, source, comm, 0, bytes(count, type)); return PMPI_##NAME(buf, count, type, source, tag, comm, req); }
IRECVS(Irecv, int) IRECVS(Irecv_c, MPI_Count)
#define MRECVS(NAME, COUNT) \
int MPI_##NAME(void *buf, COUNT count, MPI_Datatype type, MPI_Message *message, MPI_Status *status) { \
    if (*message != MPI_MESSAGE_NO_PROC) add(P2P, 0, bytes(count, type));  /* mpi4py's pickled messages */ \
    return PMPI_##NAME(buf, count, type, message, status); }
MRECVS(Mrecv, int) MRECVS(Mrecv_c, MPI_Count)
#define SENDRECVS(NAME, COUNT) \
int MPI_##NAME(const void *sbuf, COUNT scount, MPI_Datatype stype, int dest, int stag, void *rbuf, COUNT rcount, \
               MPI_Datatype rtype, int source, int rtag, MPI_Comm comm, MPI_Status *status) { \
    peer(stag, dest, comm, bytes(scount, stype), 0); peer(rtag, source, comm, 0, bytes(rcount, rtype)); \
    return PMPI_##NAME(sbuf, scount, stype, dest, stag, rbuf, rcount, rtype, source, rtag, comm, status); }
SENDRECVS(Sendrecv, int) SENDRECVS(Sendrecv_c, MPI_Count)
#define SEND_INITS(NAME, COUNT) \
int MPI_##NAME(const void *buf, COUNT count, MPI_Datatype type, int dest, int tag, MPI_Comm comm, MPI_Request *req) { \
    int status = PMPI_##NAME(buf, count, type, dest, tag, comm, req); \
    remember(*req, tag, dest, comm, bytes(count, type), 0); return status; }
SEND_INITS(Send_init, int) SEND_INITS(Send_init_c, MPI_Count)
#define RECV_INITS(NAME, COUNT) \
int MPI_##NAME(void *buf, COUNT count, MPI_Datatype type, int source, int tag, MPI_Comm comm, MPI_Request *req) { \
    int status = PMPI_##NAME(buf, count, type, source, tag, comm, req); \
    remember(*req, tag, source, comm, 0, bytes(count, type)); return status; }
RECV_INITS(Recv_init, int) RECV_INITS(Recv_init_c, MPI_Count)
int MPI_Start(MPI_Request *request) { started(*request); return PMPI_Start(request); }
int MPI_Startall(int n, MPI_Request requests[]) { for (int i = 0; i < n; i++) started(requests[i]); return PMPI_Startall(n, requests); }
int MPI_Request_free(MPI_Request *request) { forget(*request); return PMPI_Request_free(request); }
#define ALLREDUCES(NAME, COUNT) \
int MPI_##NAME(const void *sbuf, void *rbuf, COUNT count, MPI_Datatype type, MPI_Op op, MPI_Comm comm) { \
    if (ranks(comm) > 1) add(ALLREDUCE, bytes(count, type), bytes(count, type)); \
    return PMPI_##NAME(sbuf, rbuf, count, type, op, comm); }
ALLREDUCES(Allreduce, int) ALLREDUCES(Allreduce_c, MPI_Count)
#define IALLREDUCES(NAME, COUNT) \
int MPI_##NAME(const void *sbuf, void *rbuf, COUNT count, MPI_Datatype type, MPI_Op op, MPI_Comm comm, \
               MPI_Request *req) { \
    if (ranks(comm) > 1) add(ALLREDUCE, bytes(count, type), bytes(count, type)); \
    return PMPI_##NAME(sbuf, rbuf, count, type, op, comm, req); }
IALLREDUCES(Iallreduce, int) IALLREDUCES(Iallreduce_c, MPI_Count)
#define ALLTOALLS(NAME, COUNT) \
int MPI_##NAME(const void *sbuf, COUNT scount, MPI_Datatype stype, void *rbuf, COUNT rcount, MPI_Datatype rtype, \
               MPI_Comm comm) { \
    int n = ranks(comm); \
    if (n > 1) add(ALLTOALL, (n - 1) * bytes(scount, stype), (n - 1) * bytes(rcount, rtype)); \
    return PMPI_##NAME(sbuf, scount, stype, rbuf, rcount, rtype, comm); }
ALLTOALLS(Alltoall, int) ALLTOALLS(Alltoall_c, MPI_Count)
#define VBYTES(COUNTS, TYPE, COMM, OUT) do { int n_ = ranks(COMM), r_ = me(COMM); (OUT) = 0; \
    for (int i_ = 0; i_ < n_; i_++) if (i_ != r_) (OUT) += bytes((COUNTS)[i_], TYPE); } while (0)
#define ALLTOALLVS(NAME, COUNT, DISPL) \
int MPI_##NAME(const void *sbuf, const COUNT scounts[], const DISPL sdispls[], MPI_Datatype stype, void *rbuf, \
               const COUNT rcounts[], const DISPL rdispls[], MPI_Datatype rtype, MPI_Comm comm) { \
    long long out, in; VBYTES(scounts, stype, comm, out); VBYTES(rcounts, rtype, comm, in); \
    if (ranks(comm) > 1) add(ALLTOALL, out, in); \
    return PMPI_##NAME(sbuf, scounts, sdispls, stype, rbuf, rcounts, rdispls, rtype, comm); }
ALLTOALLVS(Alltoallv, int, int) ALLTOALLVS(Alltoallv_c, MPI_Count, MPI_Aint)
#define IALLTOALLVS(NAME, COUNT, DISPL) \
int MPI_##NAME(const void *sbuf, const COUNT scounts[], const DISPL sdispls[], MPI_Datatype stype, void *rbuf, \
               const COUNT rcounts[], const DISPL rdispls[], MPI_Datatype rtype, MPI_Comm comm, MPI_Request *req) { \
    long long out, in; VBYTES(scounts, stype, comm, out); VBYTES(rcounts, rtype, comm, in); \
    if (ranks(comm) > 1) add(ALLTOALL, out, in); \
    return PMPI_##NAME(sbuf, scounts, sdispls, stype, rbuf, rcounts, rdispls, rtype, comm, req); }
IALLTOALLVS(Ialltoallv, int, int) IALLTOALLVS(Ialltoallv_c, MPI_Count, MPI_Aint)
#define ALLGATHERS(NAME, COUNT) \
int MPI_##NAME(const void *sbuf, COUNT scount, MPI_Datatype stype, void *rbuf, COUNT rcount, MPI_Datatype rtype, \
               MPI_Comm comm) { \
    int n = ranks(comm); \
    if (n > 1) add(OTHER, bytes(rcount, rtype), (n - 1) * bytes(rcount, rtype)); \
    return PMPI_##NAME(sbuf, scount, stype, rbuf, rcount, rtype, comm); }
ALLGATHERS(Allgather, int) ALLGATHERS(Allgather_c, MPI_Count)
#define IALLGATHERS(NAME, COUNT) \
int MPI_##NAME(const void *sbuf, COUNT scount, MPI_Datatype stype, void *rbuf, COUNT rcount, MPI_Datatype rtype, \
               MPI_Comm comm, MPI_Request *req) { \
    int n = ranks(comm); \
    if (n > 1) add(OTHER, bytes(rcount, rtype), (n - 1) * bytes(rcount, rtype)); \
    return PMPI_##NAME(sbuf, scount, stype, rbuf, rcount, rtype, comm, req); }
IALLGATHERS(Iallgather, int) IALLGATHERS(Iallgather_c, MPI_Count)
#define ALLGATHERVS(NAME, COUNT, DISPL) \
int MPI_##NAME(const void *sbuf, COUNT scount, MPI_Datatype stype, void *rbuf, const COUNT rcounts[], \
               const DISPL displs[], MPI_Datatype rtype, MPI_Comm comm) { \
    long long in; VBYTES(rcounts, rtype, comm, in); \
    if (ranks(comm) > 1) add(OTHER, bytes(rcounts[me(comm)], rtype), in); \
    return PMPI_##NAME(sbuf, scount, stype, rbuf, rcounts, displs, rtype, comm); }
ALLGATHERVS(Allgatherv, int, int) ALLGATHERVS(Allgatherv_c, MPI_Count, MPI_Aint)
#define BCASTS(NAME, COUNT) \
int MPI_##NAME(void *buf, COUNT count, MPI_Datatype type, int root, MPI_Comm comm) { \
    if (ranks(comm) > 1) { long long b = bytes(count, type); if (me(comm) == root) add(OTHER, b, 0); else add(OTHER, 0, b); } \
    return PMPI_##NAME(buf, count, type, root, comm); }
BCASTS(Bcast, int) BCASTS(Bcast_c, MPI_Count)
#define IBCASTS(NAME, COUNT) \
int MPI_##NAME(void *buf, COUNT count, MPI_Datatype type, int root, MPI_Comm comm, MPI_Request *req) { \
    if (ranks(comm) > 1) { long long b = bytes(count, type); if (me(comm) == root) add(OTHER, b, 0); else add(OTHER, 0, b); } \
    return PMPI_##NAME(buf, count, type, root, comm, req); }
IBCASTS(Ibcast, int) IBCASTS(Ibcast_c, MPI_Count)
"""


def _traffic_library(folder):
    """Compile the profiling layer into ``folder``; return its path."""
    source, library = os.path.join(folder, "traffic.c"), os.path.join(folder, "libtraffic.so")
    with open(source, "w") as file:
        file.write(TRAFFIC_C)
    mpicc = os.path.join(os.path.dirname(sys.executable), "mpicc")
    mpicc = mpicc if os.path.exists(mpicc) else shutil.which("mpicc")
    if mpicc is None:
        raise SystemExit("credit_rollout_memory: no mpicc beside the Python or on PATH: the MPI profiling layer that "
                         "counts the bytes is compiled with it (pip install mpich gives one)")
    done = subprocess.run([mpicc, "-O2", "-shared", "-fPIC", "-o", library, source], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"credit_rollout_memory: compiling the MPI profiling layer failed:\n{done.stderr[-3000:]}")
    return library


def _case(folder, steps):
    """Write the data, the config (as CREDIT's credit rollout needs it) and the checkpoint; return the config."""
    import numpy as np
    import yaml

    from mpidomain.credit.reference import credit_checkpoint, credit_rollout_config
    from mpidomain.credit.synthetic import write_synthetic_credit

    path = os.path.join(folder, f"rollout-{steps}.yml")
    if os.path.exists(path):
        with open(path) as file:
            return yaml.safe_load(file), path
    times = np.datetime64(INIT, "ns") + np.arange(steps + 1) * np.timedelta64(6, "h")
    write_synthetic_credit(folder, GRID, variables=train_memory._variables(), config_levels=train_memory.LEVELS,
                           levels=train_memory.LEVELS, times=times)
    conf = train_memory._config(folder)
    conf["save_loc"] = os.path.join(folder, "run")
    os.makedirs(conf["save_loc"], exist_ok=True)
    conf["inference"] = {"mode": "none", "save_forecast": os.path.join(folder, "credit"),
                         "batch_forecast": {"first_init_date": INIT, "last_init_date": INIT, "init_interval": "1d",
                                            "forecast_length": f"{6 * steps}h"},
                         "output": {"format": "netcdf"}}
    conf = credit_rollout_config(conf, os.path.join(folder, "scalers"))
    credit_checkpoint(conf, os.path.join(conf["save_loc"], "checkpoint.pt"), warmup=1)
    with open(path, "w") as file:
        yaml.safe_dump(conf, file, sort_keys=False)
    return conf, path


def _worker(folder, layout, config):
    import torch
    from mpi4py import MPI
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from mpidomain.credit.config import load_config, parse_domain
    from mpidomain.credit.inference_settings import read_inference_settings
    from mpidomain.credit.rollout import RolloutOptions, rollout
    from mpidomain.credit.synthetic import synthetic_paths
    from mpidomain.manager import initialize_domain_parallel

    class Largest(TorchDispatchMode):
        """The largest tensor (its storage's bytes) any operation makes while open."""

        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for leaf in tree_leaves(out):
                if isinstance(leaf, torch.Tensor):
                    self.largest = max(self.largest, leaf.untyped_storage().nbytes())
            return out

    world = MPI.COMM_WORLD
    traffic = ctypes.CDLL(os.environ["LD_PRELOAD"])
    counts = (ctypes.c_longlong * (3 * len(KINDS)))()
    conf = load_config(config)
    domain = parse_domain(layout)
    save = os.path.join(folder, f"ours-{layout}")
    settings = read_inference_settings(conf, save_dir=save)
    manager = initialize_domain_parallel(world.size, domain if len(domain) == 2 else domain[0],
                                         (-2, -1) if len(domain) == 2 else -2)
    torch.set_num_threads(1)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    largest = Largest()
    traffic.traffic_reset()
    began = time.perf_counter()
    with largest:
        summary = rollout(conf, settings, RolloutOptions(climatology=synthetic_paths(folder)["mean"]), manager,
                          say=lambda line: None)
    seconds = time.perf_counter() - began
    traffic.traffic_read(counts)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rows, columns = summary_tile(manager)
    record = {"rank": world.rank, "peak": peak, "before": before, "largest": largest.largest,
              "read": summary.bytes_read, "seconds": seconds, "files": len(summary.files), "tile": [rows, columns],
              "sent": [counts[3 * k] for k in range(len(KINDS))],
              "received": [counts[3 * k + 1] for k in range(len(KINDS))]}
    records = world.gather(record)
    manager.close()
    if world.rank == 0:
        print(json.dumps({"layout": layout, "ranks": records}), flush=True)


def summary_tile(manager):
    """This rank's tile: (rows, columns) of the grid."""
    from mpidomain.credit.output import tile_extent

    rows, columns = tile_extent(manager, GRID)
    return len(rows), len(columns)


def _credit_run(config):
    """CREDIT's credit rollout in one process: (peak RSS, seconds)."""
    from mpidomain.credit.reference import run_credit_rollout

    began = time.perf_counter()
    done = run_credit_rollout(config, timeout=3600)
    seconds = time.perf_counter() - began
    if done["returncode"]:
        raise SystemExit(f"CREDIT's credit rollout failed:\n{done['output'][-3000:]}")
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024, seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="folder for the data and runs (default: a temporary folder, removed)")
    parser.add_argument("--layouts", default="1,2,4,2x2", help="layouts to run (default: 1,2,4,2x2)")
    parser.add_argument("--steps", type=int, default=2, help="the forecast's 6-hour steps (default: 2)")
    parser.add_argument("--no-credit", action="store_true", help="leave out CREDIT's own one-process rollout")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return _worker(args.out, args.worker, args.config)
    import numpy as np

    from mpidomain.credit import output

    folder = os.path.abspath(args.out) if args.out else tempfile.mkdtemp(prefix="credit-rollout-memory-")
    os.makedirs(folder, exist_ok=True)
    try:
        began = time.perf_counter()
        library = _traffic_library(folder)  # first: the compiler is a small child, CREDIT's run the large one
        conf, config = _case(folder, args.steps)
        prepared = time.perf_counter() - began
        credit = None
        if not args.no_credit:
            shutil.rmtree(conf["inference"]["save_forecast"], ignore_errors=True)
            credit = _credit_run(config)
        mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "OMPI_"))}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
        env["OMP_NUM_THREADS"] = "1"
        env["TRAFFIC_WRITER_TAG"] = str(output._TAG)  # ForecastWriter's messages, counted apart
        rows = []
        for layout in args.layouts.split(","):
            ranks = int(np.prod([int(p) for p in layout.split("x")]))
            command = [mpiexec, "-n", str(ranks), "-genv", "LD_PRELOAD", library, sys.executable,
                       os.path.abspath(__file__), "--out", folder, "--worker", layout, "--config", config]
            started = time.perf_counter()
            done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=3600)
            if done.returncode:
                raise SystemExit(f"{layout}: {done.stderr[-3000:]}")
            row = json.loads(done.stdout.strip().splitlines()[-1])
            row["wall"] = time.perf_counter() - started
            rows.append(row)
        _print(rows, credit, conf, args, prepared)
    finally:
        if not args.out:
            shutil.rmtree(folder, ignore_errors=True)


def _print(rows, credit, conf, args, prepared):
    from mpidomain.credit.blocks import channel_layouts

    inputs, targets = channel_layouts(conf)
    channels_in = sum(levels * times for _, levels, times in inputs)
    channels_out = sum(levels for _, levels, _ in targets)
    largest_variable = max(levels for _, levels, _ in targets)
    cells = GRID[0] * GRID[1]
    mib = lambda n: f"{n / MiB:.0f} MiB"  # noqa: E731
    print(f"credit rollout, one forecast of {args.steps} steps of 6 h on {GRID[0]} x {GRID[1]} ({channels_in} input, "
          f"{channels_out} output channels, float32), netCDF, one file per step; the largest rank of each layout:\n")
    print("| layout | peak RSS | RSS before the rollout | input + prediction held | largest tensor | bytes read | "
          "sent | received | time |")
    print("|---|---|---|---|---|---|---|---|---|")
    if credit is not None:
        print(f"| CREDIT, one process | {mib(credit[0])} | | {mib((channels_in + channels_out) * cells * 4)} (the "
              f"whole field) | | | 0 | 0 | {credit[1]:.0f} s |")
    for row in rows:
        ranks = row["ranks"]
        peak = max(r["peak"] for r in ranks)
        tile = max(r["tile"][0] * r["tile"][1] for r in ranks)
        ratio = "" if credit is None else f" ({peak / credit[0]:.2f})"
        print(f"| D={row['layout']} | {mib(peak)}{ratio} | {mib(max(r['before'] for r in ranks))} | "
              f"{mib((channels_in + channels_out) * tile * 4)} ({tile / cells:.3f}) | "
              f"{mib(max(r['largest'] for r in ranks))} | {mib(max(r['read'] for r in ranks))} | "
              f"{mib(max(sum(r['sent']) for r in ranks))} | {mib(max(sum(r['received']) for r in ranks))} | "
              f"{max(r['seconds'] for r in ranks):.0f} s |")
    print("\nbytes sent / received by kind of call, the largest rank of each kind:\n")
    print("| layout | " + " | ".join(KINDS) + " |")
    print("|---|" + "---|" * len(KINDS))
    for row in rows:
        ranks = row["ranks"]
        print(f"| D={row['layout']} | " + " | ".join(
            f"{mib(max(r['sent'][k] for r in ranks))} / {mib(max(r['received'][k] for r in ranks))}"
            for k in range(len(KINDS))) + " |")
    print(f"\nA file's writer holds, beside its tile, one chunk of one variable at one step: at most {largest_variable} "
          f"x {GRID[0]} x {GRID[1]} float32 = {mib(largest_variable * cells * 4)} (netCDF's default chunk: the whole "
          f"variable). Peak RSS ratio: to CREDIT's one process. Time: the rollout on the slowest rank, one torch "
          f"thread per rank.")
    print(f"\ndata, config and checkpoint: {prepared:.0f} s; commands (one torch thread per rank):")
    if credit is not None:
        print("  python -m mpidomain.credit.reference rollout rollout.yml   # CREDIT's credit rollout, one process")
    for row in rows:
        ranks = len(row["ranks"])
        print(f"  mpiexec -n {ranks} python -m mpidomain credit rollout -c rollout.yml -D {row['layout']} "
              f"--climatology mean.nc   # {row['wall']:.0f} s with the start")


if __name__ == "__main__":
    main()
