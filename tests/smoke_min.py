"""Smoke set of ``make test-min``: the installed wheel on the lowest declared versions.

``make test-min`` copies this file and ``min-constraints.txt`` into a temporary folder
and runs ``python smoke_min.py --versions`` (prints what is installed) and then
``pytest smoke_min.py`` there with ``.venv-min``'s Python, so ``import mlx_nbdist`` is the
installed wheel, never the checkout (``MLX_NBDIST_CHECKOUT`` names the checkout; the
first test asserts this). Nothing here needs the checkout's conftest.

Covered: ring and mpi groups of 2 ranks (start, ``all_sum`` on every rank, plan / shard /
slices / show of a small ``nn.Linear`` model, stop), a tiny mlx-lm model sharded and
generating on the ranks (mlx-lm and transformers at their floors), the dashboard in a
real ipykernel kernel (6.29.5 has no subshells: it must say its buttons act between
cells only), and no process left behind.
"""

from __future__ import annotations

import json
import os
import re
import sys
import sysconfig
import time
from importlib import metadata
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONSTRAINTS = HERE / "min-constraints.txt"
#: the processes this run starts inherit it, so the last test finds every one of them
MARK = "MLX_NBDIST_SMOKE_RUN"
os.environ.setdefault(MARK, f"smoke-{os.getpid()}")
os.environ.setdefault("MPLBACKEND", "Agg")


def pins() -> dict[str, str]:
    """``{distribution: version}`` from min-constraints.txt."""
    out = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[name.strip()] = version.strip()
    return out


def installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def print_versions() -> None:
    print(f"Python {sys.version.split()[0]} ({sys.executable})")
    for name in ["mlx_nbdist", *pins(), "jupyter_client", "pyzmq", "tornado"]:
        print(f"  {name:<16} {installed(name) or '-'}")


if __name__ == "__main__" and "--versions" in sys.argv:
    print_versions()
    sys.exit(0)

import psutil  # noqa: E402 - after the --versions exit, which needs only the stdlib
import pytest  # noqa: E402

import mlx_nbdist  # noqa: E402
from mlx_nbdist import Session  # noqa: E402

MODEL = """
class MLP(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.up, self.down = nn.Linear(d, h), nn.Linear(h, d)

    def __call__(self, x):
        return self.down(nn.relu(self.up(x)))

mx.random.seed(0)
model = MLP(32, 64)
x = mx.random.normal((4, 32), key=mx.random.key(1))
y_full = model(x)
mx.eval(y_full)
"""

TINY_LM = """
from mlx_lm.models import llama
args = llama.ModelArgs.from_dict(dict(
    model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
    num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=128,
    rope_theta=10000.0, tie_word_embeddings=False))
mx.random.seed(0)
lm = llama.Model(args)
tokens = mx.array([[1, 2, 3, 4, 5]])
full = lm(tokens)
mx.eval(full)
lm = mlx_nbdist.shard(lm)
err = mx.abs(lm(tokens) - full).max().item()
g = mlx_nbdist.generate(lm, [1, 2, 3], max_tokens=4, echo=False)
print("LM", err, len(g.tokens))
"""


def test_the_installed_wheel_is_imported() -> None:
    source = Path(os.environ["MLX_NBDIST_CHECKOUT"]).resolve() / "mlx_nbdist"
    where = Path(mlx_nbdist.__file__).resolve()
    assert not where.is_relative_to(source), f"mlx_nbdist imported from the checkout: {where}"
    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    assert where.is_relative_to(site), f"mlx_nbdist is not the installed one: {where}"
    direct = metadata.distribution("mlx_nbdist").read_text("direct_url.json") or "{}"
    assert not json.loads(direct).get("dir_info", {}).get("editable"), "an editable install"


def test_the_minimum_versions_are_installed() -> None:
    wrong = {n: (v, installed(n)) for n, v in pins().items() if installed(n) != v}
    assert not wrong, f"not at the pinned minimum (pin, installed): {wrong}"


def _all_sum_and_model(s: Session) -> None:
    r = s.run("y = mx.distributed.all_sum(mx.ones(4) * (rank + 1), group=world)\n"
              "print('SUM', rank, size, y.tolist())")  # fmt: skip
    for rank in range(2):
        assert f"SUM {rank} 2 [3.0, 3.0, 3.0, 3.0]" in r.stdout(rank), r.stdout(rank)

    s.run(MODEL)
    table = mlx_nbdist.plan("model", "megatron", session=s)
    shapes = {row.path: (row.full_shape, row.local_shape) for row in table.rows}
    assert shapes["up.weight"] == ((64, 32), (32, 32)), shapes
    assert shapes["down.weight"] == ((32, 64), (32, 32)), shapes
    mlx_nbdist.shard("model", "megatron", session=s)
    r = s.run("print('ERR', mx.abs(model(x) - y_full).max().item())")
    for rank in range(2):
        err = float(re.search(r"ERR (\S+)", r.stdout(rank)).group(1))
        assert err < 1e-5, f"rank {rank}: sharded output differs by {err}"
    got = mlx_nbdist.slices("model.up.weight", session=s)
    assert sorted((t.rank, t.shape, tuple(t.ranges)) for t in got) == [
        (0, (32, 32), ((0, 32),)),
        (1, (32, 32), ((32, 64),)),
    ]
    fig = mlx_nbdist.show("model.up.weight", session=s)
    assert fig is not None


@pytest.mark.parametrize("backend", ["ring", "mpi"])
def test_group_of_two(backend: str) -> None:
    s = Session(2, backend=backend, timeout=120)
    t0 = time.monotonic()
    try:
        s.start()
        print(f"{backend}: started in {time.monotonic() - t0:.1f} s")
        _all_sum_and_model(s)
        if backend == "ring":  # a figure shows without plt.show() (the inline backend)
            r = s.run("import matplotlib.pyplot as plt\nplt.plot([0, rank + 1])")
            for rank in range(2):
                assert any("image/png" in o["data"] for o in r.ranks[rank].outputs)
            s.restart()  # onto the spare, or new engines while it still starts
            r = s.run("float(mx.distributed.all_sum(mx.ones(1), group=world).item())")
            assert [r.ranks[k].result_text for k in range(2)] == ["2.0", "2.0"]
        if backend == "ring" and installed("mlx-lm"):
            r = s.run(TINY_LM)
            for rank in range(2):
                _, err, n = r.stdout(rank).split()[-3:]
                assert float(err) < 1e-4 and n == "4", r.stdout(rank)
    finally:
        s.stop()


KERNEL_CELLS = [
    "%load_ext mlx_nbdist\n%mlxdist start -n 2",
    "%%mlxdist\nprint('SUM', rank, mx.distributed.all_sum(mx.ones(2), group=world).tolist())",
    "import ipykernel, mlx_nbdist\nd = mlx_nbdist.dashboard()\n"
    "print('DASH', ipykernel.__version__, d.live_controls, d.hint.value)\nd.close()",
    "%mlxdist stop",
]


def test_dashboard_in_an_old_kernel_says_buttons_act_between_cells(tmp_path: Path) -> None:
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    spec = tmp_path / "kernels" / "smoke"
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(json.dumps(
        {"argv": argv, "display_name": "smoke", "language": "python"}))  # fmt: skip
    km = KernelManager(
        kernel_name="smoke", kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(spec.parent)])
    )
    km.start_kernel(cwd=str(tmp_path))
    kc = km.client()
    kc.start_channels()
    texts = []
    try:
        kc.wait_for_ready(timeout=120)
        for code in KERNEL_CELLS:
            out: list[str] = []

            def hook(msg: dict, out: list[str] = out) -> None:
                c = msg["content"]
                if msg["msg_type"] == "stream":
                    out.append(c["text"])
                elif msg["msg_type"] == "error":
                    out.append(f"{c['ename']}: {c['evalue']}\n")
                elif "data" in c:  # the ranks' output areas: displays, updated by id
                    out.append(c["data"].get("text/plain", "") + "\n")

            reply = kc.execute_interactive(code, output_hook=hook, timeout=180)
            text = "".join(out)
            texts.append(text)
            assert reply["content"]["status"] == "ok", f"{code!r} failed:\n{text}"
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=False)
    assert "MLX group ready: 2 ranks" in texts[0]
    assert "SUM 0 [2.0, 2.0]" in texts[1] and "SUM 1 [2.0, 2.0]" in texts[1], texts[1]
    dash = next(line for line in texts[2].splitlines() if line.startswith("DASH"))
    assert dash.startswith(f"DASH {installed('ipykernel')} False "), dash
    assert "buttons only between cells" in dash, dash
    assert "stopped" in texts[3]


def test_no_process_left() -> None:
    """Every engine, controller, mpirun and kernel this run started has ended."""
    mark = os.environ[MARK]

    def ours() -> list[str]:
        found = []
        for p in psutil.process_iter():
            try:
                mine = p.pid != os.getpid() and p.environ().get(MARK) == mark
                if mine and p.status() != psutil.STATUS_ZOMBIE:
                    found.append(f"{p.pid}: {' '.join(p.cmdline())[:160]}")
            except psutil.Error:
                pass
        return found

    t_end = time.monotonic() + 20
    left = ours()
    while left and time.monotonic() < t_end:
        time.sleep(0.5)
        left = ours()
    assert not left, "left running:\n" + "\n".join(left)
