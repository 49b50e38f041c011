"""Keeping engines honest between syncs, and finishing a sync the agent died in.

``reconcile_once`` (every ``sync.reconcile_interval_s``):

- an engine marked for reload (it may hold mixed weights after a failed update; the mark is
  persisted) is reloaded from disk (``/update_weights_from_disk``) when a source is known: the
  trainer's newest export named in a sync request, or ``sync.reload_path``;
- an engine the agent quarantined is released once it is not marked for reload and serves
  the current version (so it rejoins at the right version — after a reload from an export at
  that version, or after the next sync pushed it the weights);
- a routable engine that serves another version than the current one (e.g. it restarted
  with its initial weights) is quarantined until it catches up.

``recover`` runs at start (and every round until it succeeds) when the state file shows a
sync that never finished; until then new syncs get 503 ``recovering``. If every live member
reports the target version (set only with the last bucket, so it loaded them all) the sync is
finished (continue, resume at the new version), otherwise it is rolled back (resume at the old
version). An agent that died while loading leaves engines that may be mixed without knowing it
(SGLang cannot say either): every member not at the new version is quarantined and reloaded.
Either way the group is dropped and open weight-update sessions are closed: engines' state
after a crash is unknown, and the trainer is told to form a new one (409 regroup).
"""

from __future__ import annotations

import logging

from asyncrl.engine_client.errors import EngineError, EngineHTTPError
from asyncrl.wire.sync import DEFAULT_GROUP_NAME
from sync_agent.coordinator import SyncCoordinator
from sync_agent.fleet import AGENT_REASON
from sync_agent.rollout_admin import RolloutAdminError

log = logging.getLogger(__name__)


async def reconcile_once(co: SyncCoordinator) -> None:
    if co.running is not None:
        return  # a sync owns the engines right now
    if co.unfinished is not None:  # recovery at start could not finish (e.g. the rollout service was unreachable)
        await recover(co)
        return
    try:
        views = await co.engine_views()
    except RolloutAdminError as exc:
        log.debug("reconcile: rollout service unreachable: %s", exc)
        return
    source = co.reload_source()
    for v in views:
        if not v.alive:
            continue
        eid = v.id
        client = co.client(eid, v.url)
        if eid in co.needs_reload and source is not None:
            try:
                await repair(co, client, *source)
                co.needs_reload.discard(eid)
                co.persist()
                v.version = source[1]
                log.info("engine %s reloaded from %s (version %d)", eid, *source)
            except EngineError as exc:
                log.warning("reloading engine %s from %s failed (it may still sit in a failed sync's collective): %s",
                            eid, source[0], exc)
                continue
        healthy_here = eid not in co.needs_reload and v.version == co.version
        ours = (v.reason or "").startswith(AGENT_REASON)
        try:
            if v.rollout_state == "quarantined" and ours and healthy_here:
                await client.resume()  # a failed sync may have left it paused
                await co.rollout.release(eid)
                log.info("engine %s released at version %d", eid, co.version)
            elif v.rollout_state != "quarantined" and not healthy_here:
                why = "may hold mixed weights" if eid in co.needs_reload else f"serves version {v.version}, current is {co.version}"
                await co.rollout.quarantine(eid, f"{AGENT_REASON} {why}")
                log.warning("engine %s quarantined: %s", eid, why)
        except (RolloutAdminError, EngineError) as exc:
            log.warning("reconcile of %s: %s", eid, exc)


async def repair(co: SyncCoordinator, client, path: str, version: int) -> None:
    """Bring an engine a failed sync left behind back to whole weights: close its session and
    group (either may be gone: 400/404 are fine), reload every weight from ``path``, flush,
    continue. Raises EngineError when it does not answer (still stuck: next round)."""
    t = co.settings.sync.engine_timeout_s
    for call in (client.end_weight_update, lambda timeout_s: client.destroy_weights_update_group(timeout_s=timeout_s)):
        try:
            await call(timeout_s=t)
        except EngineHTTPError as exc:
            if exc.status >= 500:
                raise
    await client.update_weights_from_disk(path, weight_version=version, timeout_s=t * 4)
    try:
        await client.flush_cache(retries=1, timeout_s=t, wait_s=1.5)
    except EngineHTTPError as exc:  # a stale prefix cache only costs hits; the weights are whole
        log.info("flush after reloading: %s", exc)
    await client.resume(timeout_s=t)


async def recover(co: SyncCoordinator) -> str | None:
    """Finish or roll back a sync the previous agent process did not complete."""
    rec = co.unfinished
    if rec is None:
        return None
    try:
        views = {v.id: v for v in await co.engine_views()}
    except RolloutAdminError as exc:
        log.error("cannot recover sync %s yet: %s", rec.id, exc)
        return None
    members = [views[eid] for eid in rec.member_urls if eid in views and views[eid].alive]
    complete = bool(members) and all(m.version == rec.version for m in members)
    # Died while loading (or failing): an engine that did not get the last bucket (which
    # carries the new version) may hold some new parameters and some old ones, and no failed
    # call told it so. Treat it as mixed: quarantine and reload.
    maybe_mixed = rec.state in ("loading", "failing") and rec.adapter is None  # an adapter loads whole or not at all
    for m in members:
        client = co.client(m.id, m.url)
        if (m.version not in (rec.version, rec.previous_version)
                or (maybe_mixed and not complete and m.version != rec.version)):
            if rec.adapter is None:  # an adapter sync never touches the base weights: the next sync brings it
                co.needs_reload.add(m.id)
            try:
                await co.rollout.quarantine(m.id, f"{AGENT_REASON} agent restarted during the update to version {rec.version}")
            except RolloutAdminError as exc:
                log.error("could not quarantine %s: %s", m.id, exc)
        try:
            await client.destroy_weights_update_group(co.group.group_name if co.group else DEFAULT_GROUP_NAME)
        except EngineError:
            pass
        try:
            await client.end_weight_update()
        except EngineHTTPError:
            pass  # 400: no session open (the dead agent had not begun one, or closed it)
        except EngineError:
            pass
        try:
            await client.resume()
        except EngineError:
            pass
    co.group = None
    if complete:
        co.version = rec.version
        rec.engines = {m.id: "loaded" for m in members}
    else:
        rec.error = f"the agent restarted during {rec.state}; rolled back to version {co.version}"
        rec.engines = {m.id: ("loaded" if m.version == rec.version else "unchanged") for m in members}
    await co._resume_rollout(rec)
    co.unfinished = None
    co._enter(rec, "succeeded" if complete else "failed")
    log.warning("recovered sync %s after a restart: %s", rec.id, rec.state)
    return rec.state
