"""How verl 0.9.1, slime and AReaL 1.0.4 start SGLang, pinned to the lines
docs/notes/framework-engine-startup.md cites (read statically: nothing here is imported).

* verl and AReaL: their installed packages (the ``verl`` / ``areal`` test extras,
  ``--no-deps``; the files are the PyPI wheels' own), found with ``find_spec`` and parsed.
* SGLang: each release's wheel in the cache :mod:`tests.engine.test_release_wheels` fills
  (``$R3_WHEEL_CACHE`` or ``~/.cache/sglang-r3/wheels``); a release not cached is skipped,
  never downloaded here.
* slime: ``git show`` of the commit docs/integrations.md cites, from the git directory
  ``$R3_SLIME_GIT_DIR`` names (a clone or mirror of THUDM/slime); skipped when unset.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import zipfile
from functools import cache
from importlib import metadata
from pathlib import Path

import pytest

from sglang_r3.releases import Release
from sglang_r3.targets import T_LAUNCH

ROOT = Path(__file__).resolve().parents[2]
NOTES = ROOT / "docs" / "notes" / "framework-engine-startup.md"
SLIME_COMMIT = "624b824a898ab0ec1fcb4d373004c7f3852bf515"
#: The SGLang releases our range covers (tests/engine/test_release_wheels.py lists them all).
RANGE = ("0.5.12", "0.5.13", "0.5.15", "0.5.17", "0.5.18", "0.5.21", "0.5.22", "0.5.23")


# ------------------------------------------------------------------ reading sources


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)  # a top-level package: found, not imported
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"{name} is not installed (scripts/bootstrap.sh, the `{name}` extra)")
    return Path(next(iter(spec.submodule_search_locations)))


@cache
def _text(package: str, path: str) -> str:
    return (_package_dir(package) / path).read_text()


def _line(source: str, number: int) -> str:
    return source.splitlines()[number - 1]


def _at(source: str, where: str, number: int, *fragments: str) -> None:
    """Line ``number`` of ``source`` (``where``, for the message) holds each fragment."""
    line = _line(source, number)
    for fragment in fragments:
        assert fragment in line, f"{where}:{number} is {line.strip()!r}, not {fragment!r}"


def _function(tree: ast.AST, qualname: str) -> ast.FunctionDef | ast.AsyncFunctionDef:
    """The (async) function ``Class.name`` or ``name`` defined in ``tree``."""
    *owner, name = qualname.split(".")
    scope: ast.AST = tree
    for cls in owner:
        scope = next(
            n for n in ast.iter_child_nodes(scope) if isinstance(n, ast.ClassDef) and n.name == cls
        )
    for node in ast.iter_child_nodes(scope):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
            return node
    raise AssertionError(f"no {qualname}")


def _calls(node: ast.AST, callee: str) -> list[ast.Call]:
    """Calls in ``node`` whose callee is written ``callee`` (``ast.unparse``)."""
    return [n for n in ast.walk(node) if isinstance(n, ast.Call) and ast.unparse(n.func) == callee]


def _keywords(call: ast.Call) -> dict[str | None, str]:
    return {k.arg: ast.unparse(k.value) for k in call.keywords}


# ------------------------------------------------------------------ verl 0.9.1

_VERL_SERVER = "workers/rollout/sglang_rollout/async_sglang_server.py"


@cache
def _verl_server() -> tuple[str, ast.Module]:
    source = _text("verl", _VERL_SERVER)
    return source, ast.parse(source)


def test_verl_pins_sglang_0_5_12() -> None:
    """verl 0.9.1 METADATA:89: ``Requires-Dist: sglang==0.5.12; extra == "sglang"``."""
    _package_dir("verl")
    assert metadata.version("verl") == "0.9.1"
    assert 'sglang==0.5.12; extra == "sglang"' in (metadata.requires("verl") or [])
    _at(metadata.distribution("verl").read_text("METADATA") or "", "METADATA", 89, "sglang==0.5.12")


def test_verl_starts_sglang_in_its_server_actor_through_engine_launch_subprocesses() -> None:
    """``async_sglang_server.py:790`` makes ``SGLangHttpServer`` a Ray actor; its
    ``launch_server`` builds ``ServerArgs`` (:424), then on sglang>=0.5.10 (:427) calls
    ``Engine._launch_subprocesses`` with upstream's three process functions (:430-435), and
    serves ``http_server.app`` with its own uvicorn (:477).  It never imports
    ``http_server.launch_server`` (our ``T_LAUNCH`` target): its imports from there are
    :30-35 and :428."""
    source, tree = _verl_server()
    where = f"verl/{_VERL_SERVER}"
    launch = _function(tree, "SGLangHttpServer.launch_server")
    [call] = _calls(launch, "Engine._launch_subprocesses")
    assert call.lineno == 430, call.lineno
    engine = "sglang.srt.entrypoints.engine"
    assert _keywords(call) == {
        "server_args": "server_args",
        "init_tokenizer_manager_func": f"{engine}.init_tokenizer_manager",
        "run_scheduler_process_func": f"{engine}.run_scheduler_process",
        "run_detokenizer_process_func": f"{engine}.run_detokenizer_process",
    }
    _at(source, where, 427, 'version.parse("0.5.10")')
    _at(source, where, 424, "server_args = ServerArgs(**args)")
    _at(source, where, 422, "sglang.srt.entrypoints.engine._set_envs_and_config")
    [uvicorn] = _calls(launch, "run_uvicorn")
    assert uvicorn.lineno == 477 and ast.unparse(uvicorn.args[0]) == "app"
    _at(source, where, 790, "self.server_class = ray.remote(SGLangHttpServer)")

    http_server, launch_name = T_LAUNCH.rsplit(".", 1)
    imported = {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == http_server
        for alias in node.names
    }
    assert launch_name not in imported, imported
    assert imported == {"ServerArgs", "_GlobalState", "app", "set_global_state", "Engine"} | {
        "_launch_subprocesses"  # the sglang<0.5.10 branches (:437, :446)
    }


def test_verl_turns_on_routed_experts_from_its_config() -> None:
    """``enable_rollout_routing_replay`` (``workers/config/rollout.py:265``, default False)
    sets ``enable_return_routed_experts`` (``async_sglang_server.py:403-404``); the server
    flag alone comes through ``engine_kwargs.sglang`` spread into the args (:276, :340)."""
    source, _ = _verl_server()
    where = f"verl/{_VERL_SERVER}"
    _at(source, where, 403, "if self.config.enable_rollout_routing_replay:")
    _at(source, where, 404, 'args.update({"enable_return_routed_experts": True})')
    _at(source, where, 276, 'self.config.get("engine_kwargs", {}).get("sglang", {})')
    _at(source, where, 340, "**engine_kwargs,")
    rollout = _text("verl", "workers/config/rollout.py")
    where = "verl/workers/config/rollout.py"
    _at(rollout, where, 265, "enable_rollout_routing_replay: bool = False")


def test_verl_asks_and_reads_routed_experts_in_process() -> None:
    """``SGLangHttpServer.generate`` (:546) adds ``return_routed_experts`` (:641-642), calls
    the tokenizer manager in-process (:657) and reads ``meta_info["routed_experts"]``
    (:685, decoded at :688-699), returned as ``TokenOutput.routed_experts`` (:721)."""
    source, tree = _verl_server()
    where = f"verl/{_VERL_SERVER}"
    assert _function(tree, "SGLangHttpServer.generate").lineno == 546
    _at(source, where, 641, "if self.config.enable_rollout_routing_replay:")
    _at(source, where, 642, 'request.update({"return_routed_experts": True})')
    _at(source, where, 657, "self.tokenizer_manager.generate_request(generate_request, None)")
    _at(source, where, 685, '.get("routed_experts", None)')
    _at(source, where, 697, "extract_routed_experts_from_meta_info(output)")
    _at(source, where, 721, "routed_experts=routed_experts")


def test_verl_server_actor_env_comes_from_the_job_runtime_env() -> None:
    """The server actor's own ``runtime_env.env_vars`` is the platform's only
    (``async_sglang_server.py:849-854``); ``main_ppo.py:62-74`` merges
    ``ray_kwargs.ray_init.runtime_env`` (``ppo_trainer.yaml:517-518``) into ``ray.init``,
    skipped when Ray is already up (:57)."""
    _, tree = _verl_server()
    replica = _function(tree, "SGLangReplica.launch_servers")
    [options] = _calls(replica, "self.server_class.options")
    runtime_env = next(k.value for k in options.keywords if k.arg == "runtime_env")
    assert isinstance(runtime_env, ast.Dict) and runtime_env.lineno == 849
    [env_vars] = runtime_env.values
    assert isinstance(env_vars, ast.Dict)
    assert env_vars.keys == [None, None], "only ** splats, no variable of ours"
    assert [ast.unparse(v) for v in env_vars.values] == [
        "{var: '1' for var in get_platform().ray_noset_envvars()}",
        "get_platform().rollout_env_vars()",
    ]
    main, where = _text("verl", "trainer/main_ppo.py"), "verl/trainer/main_ppo.py"
    _at(main, where, 57, "if not ray.is_initialized():")
    _at(main, where, 64, 'ray_init_kwargs.get("runtime_env", {})')
    _at(main, where, 71, "OmegaConf.merge(default_runtime_env, runtime_env_kwargs)")
    _at(main, where, 74, "ray.init(**OmegaConf.to_container(ray_init_kwargs))")
    yaml = _text("verl", "trainer/config/ppo_trainer.yaml")
    _at(yaml, "verl/trainer/config/ppo_trainer.yaml", 518, "runtime_env:")


# ------------------------------------------------------------------ SGLang, per release


def _wheel(version: str) -> zipfile.ZipFile:
    cache_dir = Path(os.environ.get("R3_WHEEL_CACHE") or Path.home() / ".cache/sglang-r3/wheels")
    found = sorted(cache_dir.glob(f"sglang-{version}-*.whl"))
    if not found:
        pytest.skip(f"SGLang {version}'s wheel is not in {cache_dir} (test_release_wheels.py)")
    return zipfile.ZipFile(found[0])


@cache
def _sglang(version: str, path: str) -> tuple[str, ast.Module]:
    with _wheel(version) as wheel:
        source = wheel.read(f"sglang/{path}").decode()
    return source, ast.parse(source)


@pytest.mark.parametrize("version", RANGE)
def test_sglang_loads_plugins_inside_launch_subprocesses(version: str) -> None:
    """In every release ``Engine._launch_subprocesses`` calls ``load_plugins()`` before it
    starts the detokenizer (0.5.12 ``srt/entrypoints/engine.py:765`` < :842), while
    ``http_server.launch_server`` loads none itself and goes straight to it (0.5.12
    ``http_server.py:2345``): so a hook on ``launch_server`` cannot wrap a call that
    loaded the plugins (slime's path), while a later class-attribute lookup
    (``_launch_detokenizer_subprocesses``) sees hooks.  The detokenizer process loads
    plugins itself exactly where ``sglang_r3.releases`` says ``detokenizer_plugins``."""
    _, engine = _sglang(version, "srt/entrypoints/engine.py")
    launch = _function(engine, "Engine._launch_subprocesses")
    [load] = _calls(launch, "load_plugins")
    [detok] = _calls(launch, "cls._launch_detokenizer_subprocesses")
    assert load.lineno < detok.lineno
    assert "run_detokenizer_process_func" in _keywords(detok)

    _, http = _sglang(version, "srt/entrypoints/http_server.py")
    server = _function(http, "launch_server")
    assert not _calls(server, "load_plugins")
    assert _calls(server, "Engine._launch_subprocesses")
    default = dict(
        zip(
            [a.arg for a in server.args.args[-len(server.args.defaults) :]],
            [ast.unparse(d) for d in server.args.defaults],
            strict=True,
        )
    )
    assert default["run_detokenizer_process_func"] == "run_detokenizer_process"

    _, detokenizer = _sglang(version, "srt/managers/detokenizer_manager.py")
    own = bool(_calls(_function(detokenizer, "run_detokenizer_process"), "load_plugins"))
    assert own == Release(version).has("detokenizer_plugins"), version


def test_sglang_0_5_12_lines() -> None:
    """The 0.5.12 lines the note cites: engine.py:740, 765, 842; http_server.py:2315,
    2319, 2345; scheduler.py:3999 (the scheduler loads its own plugins)."""
    engine, _ = _sglang("0.5.12", "srt/entrypoints/engine.py")
    _at(engine, "engine.py", 740, "def _launch_subprocesses(")
    _at(engine, "engine.py", 765, "load_plugins()")
    _at(engine, "engine.py", 842, "cls._launch_detokenizer_subprocesses(")
    http, _ = _sglang("0.5.12", "srt/entrypoints/http_server.py")
    _at(http, "http_server.py", 2315, "def launch_server(")
    _at(http, "http_server.py", 2319, "run_detokenizer_process_func: Callable = run_detokenizer")
    _at(http, "http_server.py", 2345, "Engine._launch_subprocesses(")
    scheduler, _ = _sglang("0.5.12", "srt/managers/scheduler.py")
    _at(scheduler, "scheduler.py", 3999, "load_plugins()")


# ------------------------------------------------------------------ AReaL 1.0.4


def test_areal_pins_sglang_0_5_10_post1_and_torch_below_2_11() -> None:
    """AReaL 1.0.4 METADATA:117 pins ``sglang[tracing]==0.5.10.post1`` (its ``sglang``
    extra), METADATA:19 ``torch>=2.9.1,<2.11``; 0.5.10.post1 has no plugin loader
    (``tests/engine/test_release_wheels.py::test_outside_range_fails``)."""
    _package_dir("areal")
    assert metadata.version("areal") == "1.0.4"
    requires = metadata.requires("areal") or []
    sglang = "sglang[tracing]==0.5.10.post1 ; platform_machine == 'x86_64' and "
    assert f"{sglang}sys_platform == 'linux' and extra == 'sglang'" in requires
    torch = "torch>=2.9.1,<2.11 ; platform_machine != 'x86_64' or sys_platform != 'darwin'"
    assert torch in requires
    meta = metadata.distribution("areal").read_text("METADATA") or ""
    _at(meta, "METADATA", 117, "sglang[tracing]==0.5.10.post1")
    _at(meta, "METADATA", 19, "torch>=2.9.1,<2.11")
    assert not Release("0.5.10.post1").supported


def test_areal_remote_engine_takes_server_addresses() -> None:
    """``RemoteInfEngine.initialize`` (``areal/infra/remote_inf_engine.py:406``) takes
    ``addr`` first (:431), then its own subprocesses (:434), then name_resolve when
    ``experiment_name`` / ``trial_name`` are set (:439-449), and only on that lookup's
    failure ``AREAL_LLM_SERVER_ADDRS``, comma-separated (:455-458)."""
    path = "infra/remote_inf_engine.py"
    source = _text("areal", path)
    where = f"areal/{path}"
    initialize = _function(ast.parse(source), "RemoteInfEngine.initialize")
    assert initialize.lineno == 406
    assert [a.arg for a in initialize.args.args] == [
        "self",
        "engine_id",
        "addr",
        "train_data_parallel_size",
    ]
    _at(source, where, 431, "if addr:")
    _at(source, where, 432, "self.addresses = addr if isinstance(addr, list) else [addr]")
    _at(source, where, 434, "elif len(self.local_server_processes) > 0:")
    _at(source, where, 440, "self.config.experiment_name is not None")
    _at(source, where, 444, "self.addresses = wait_llm_server_addrs(")
    _at(source, where, 450, "except (TimeoutError, RuntimeError):")
    _at(source, where, 455, 'os.getenv("AREAL_LLM_SERVER_ADDRS")')
    _at(source, where, 458, 'self.addresses = addrs_str.split(",")')
    launcher = _text("areal", "infra/utils/launcher.py")
    _at(launcher, "areal/infra/utils/launcher.py", 208, "names.gen_servers(")
    _at(launcher, "areal/infra/utils/launcher.py", 211, "name_resolve.get_subtree(name)")


def test_areal_trainer_passes_no_addresses() -> None:
    """``PPOTrainer._init_rollout``: in SPMD mode (``AREAL_SPMD_MODE``,
    ``areal/utils/environ.py:33-34``) ``engine.initialize(train_data_parallel_size=...)``
    without ``addr`` (``rl_trainer.py:1067-1072``); single-controller mode always launches,
    ``server_infos`` being passed for eval-rollout only (:1081-1089;
    ``rollout_controller.py:270`` connects to them, :293-296 launches)."""
    path = "trainer/rl_trainer.py"
    source = _text("areal", path)
    where = f"areal/{path}"
    init = _function(ast.parse(source), "PPOTrainer._init_rollout")
    [spmd] = _calls(init, "engine.initialize")
    assert spmd.lineno == 1069 and set(_keywords(spmd)) == {"train_data_parallel_size"}
    [controller] = _calls(init, "controller.initialize")
    assert controller.lineno == 1089
    _at(source, where, 1067, "if not is_single_controller():")
    _at(source, where, 1085, "if is_eval:")
    _at(source, where, 1087, 'init_kwargs["server_infos"] = self.rollout.server_infos')
    environ = _text("areal", "utils/environ.py")
    _at(environ, "areal/utils/environ.py", 34, 'return not get_bool_env_var("AREAL_SPMD_MODE")')
    rc = _text("areal", "infra/controller/rollout_controller.py")
    where = "areal/infra/controller/rollout_controller.py"
    _at(rc, where, 270, "if server_infos is not None:")
    _at(rc, where, 294, "self.server_infos = await self._collective_rpc_async(")
    _at(rc, where, 295, '"launch_server", server_args=server_args')


def test_areal_own_launcher_cannot_run_our_range() -> None:
    """AReaL starts servers as ``python3 -m areal.experimental.inference_service.sglang.
    launch_server`` (``cli_args.py:1911-1913``), whose scheduler function imports
    ``configure_scheduler`` (``.../sglang/scheduler.py:173``): a name SGLang 0.5.12-0.5.23
    no longer has (``configure_scheduler_process``, 0.5.12 ``scheduler.py:3929``).  No
    AReaL file calls ``load_plugins``; ``SGLangConfig.build_args`` needs an installed
    sglang>=0.5.10.post1 in the trainer's environment (``cli_args.py:1961-1962``)."""
    cli, where = _text("areal", "api/cli_args.py"), "areal/api/cli_args.py"
    _at(cli, where, 1912, '"areal.experimental.inference_service.sglang.launch_server"')
    _at(cli, where, 1961, 'is_version_greater_or_equal("sglang", "0.5.10.post1")')
    launch = _text("areal", "experimental/inference_service/sglang/launch_server.py")
    _at(launch, "launch_server.py", 47, "Engine._launch_subprocesses(")
    _at(launch, "launch_server.py", 51, "run_scheduler_process_func=areal_run_scheduler_process")
    scheduler = _text("areal", "experimental/inference_service/sglang/scheduler.py")
    _at(scheduler, "scheduler.py", 173, "configure_scheduler")
    imported = {
        alias.name
        for node in ast.walk(ast.parse(scheduler))
        if isinstance(node, ast.ImportFrom) and node.module == "sglang.srt.managers.scheduler"
        for alias in node.names
    }
    assert "configure_scheduler" in imported, imported
    for version in ("0.5.12", "0.5.23"):
        _, tree = _sglang(version, "srt/managers/scheduler.py")
        top = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert "configure_scheduler" not in top and "configure_scheduler_process" in top
    _at(_sglang("0.5.12", "srt/managers/scheduler.py")[0], "scheduler.py", 3929, "def configure_")
    areal = _package_dir("areal")
    callers = [p for p in areal.rglob("*.py") if "load_plugins" in p.read_text(errors="replace")]
    assert not callers, callers


# ------------------------------------------------------------------ slime @ 624b824


def _slime(path: str) -> str:
    git_dir = os.environ.get("R3_SLIME_GIT_DIR")
    if not git_dir:
        pytest.skip("R3_SLIME_GIT_DIR is unset (a git directory holding THUDM/slime)")
    done = subprocess.run(
        ["git", f"--git-dir={git_dir}", "show", f"{SLIME_COMMIT}:{path}"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    if done.returncode:
        pytest.skip(f"{git_dir} lacks {SLIME_COMMIT}:{path}: {done.stderr.strip()}")
    return done.stdout


def test_docs_cite_the_slime_commit() -> None:
    """docs/integrations.md and the note read slime at the same commit."""
    assert SLIME_COMMIT in (ROOT / "docs" / "integrations.md").read_text()
    assert SLIME_COMMIT in NOTES.read_text()


def test_slime_spawns_http_server_launch_server() -> None:
    """``slime/backends/sglang_utils/sglang_engine.py:48-53``: the ``SGLangEngine`` Ray
    actor (``slime/ray/rollout.py:121``) spawns ``http_server.launch_server`` with no
    overrides; ``--use-rollout-routing-replay`` sets ``enable_return_routed_experts``
    (:569-570); the actor's env_vars are slime's own (``rollout.py:159-160``)."""
    path = "slime/backends/sglang_utils/sglang_engine.py"
    engine = _slime(path)
    _at(engine, path, 48, "from sglang.srt.entrypoints.http_server import launch_server")
    _at(engine, path, 50, 'multiprocessing.set_start_method("spawn", force=True)')
    _at(engine, path, 52, "multiprocessing.Process(target=launch_server, args=(server_args,))")
    _at(engine, path, 569, "if args.use_rollout_routing_replay:")
    _at(engine, path, 570, 'kwargs["enable_return_routed_experts"] = True')
    _at(engine, path, 152, "if self.args.rollout_external:")
    rollout = _slime("slime/ray/rollout.py")
    _at(rollout, "slime/ray/rollout.py", 121, "RolloutRayActor = ray.remote(SGLangEngine)")
    _at(rollout, "slime/ray/rollout.py", 160, '"env_vars": add_default_ray_env_vars(env_vars)')
    args = _slime("slime/utils/arguments.py")
    _at(args, "slime/utils/arguments.py", 569, '"--rollout-external-engine-addrs"')
    _at(args, "slime/utils/arguments.py", 1098, '"--use-rollout-routing-replay"')
    _at(_slime("docker/Dockerfile"), "docker/Dockerfile", 1, "v0.5.15.post1")
