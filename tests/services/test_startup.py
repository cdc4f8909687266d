import gc

from services.startup import freeze_after_startup


def test_freeze_moves_startup_objects_out_of_the_collectors_reach() -> None:
    built_at_startup = [[i] for i in range(1000)]
    try:
        frozen = freeze_after_startup()
        assert frozen >= len(built_at_startup)
        young = {id(o) for o in gc.get_objects()}
        assert not any(id(o) in young for o in built_at_startup)
        served = [0]  # what serving allocates afterwards is still collected
        assert any(o is served for o in gc.get_objects())
    finally:
        gc.unfreeze()


async def _loop_module() -> str:
    import asyncio

    return type(asyncio.get_running_loop()).__module__


def test_services_run_on_uvloop_unless_told_otherwise(monkeypatch) -> None:
    from services.startup import run_event_loop

    monkeypatch.delenv("KVLEDGER_EVENT_LOOP", raising=False)
    assert run_event_loop(_loop_module()).startswith("uvloop")
    monkeypatch.setenv("KVLEDGER_EVENT_LOOP", "asyncio")
    assert run_event_loop(_loop_module()).startswith("asyncio")
