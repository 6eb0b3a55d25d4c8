from deployments.engine.aborted_ids import AbortedIds


def test_an_abort_is_remembered_until_it_expires():
    ids = AbortedIds(remember_s=10.0)
    ids.add("r-1", now=100.0)
    assert ids.contains("r-1", now=105.0)
    assert not ids.contains("r-2", now=105.0)
    assert not ids.contains("r-1", now=110.0)


def test_expired_ids_are_forgotten_and_the_set_is_capped():
    ids = AbortedIds(remember_s=10.0, max_remembered=3)
    for i in range(3):
        ids.add(f"old-{i}", now=0.0)
    ids.add("new", now=20.0)  # the three old ones expired
    assert len(ids) == 1
    for i in range(5):
        ids.add(f"burst-{i}", now=21.0)
    assert len(ids) == 3
    assert ids.contains("burst-4", now=21.0) and not ids.contains("burst-0", now=21.0)
