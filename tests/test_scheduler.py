import pytest

from ddtree_rtc.engine.kv_cache import PageAllocator
from ddtree_rtc.engine.request import FinishReason, Request, RequestError
from ddtree_rtc.engine.scheduler import Scheduler


def req(rid, n_prompt=5, new=3, **kw):
    return Request(rid=rid, prompt=list(range(1, n_prompt + 1)), max_new_tokens=new, **kw)


def test_request_validation():
    with pytest.raises(RequestError, match="outside the vocabulary"):
        Request(0, [1, 99], 4).validate(vocab_size=50, max_context=100)
    with pytest.raises(RequestError, match="exceeds the cache's max context 10"):
        req(1, 8, 5).validate(vocab_size=50, max_context=10)
    with pytest.raises(RequestError, match="empty prompt"):
        Request(2, [], 4).validate(50, 100)
    req(3).validate(50, 100)


def test_finish_reasons():
    r = req(0, new=5, stop_ids=(7,))
    assert not r.append(3, eos_id=2)
    assert r.append(7, eos_id=2) and r.finish == FinishReason.STOP
    r = req(1, new=5)
    assert r.append(2, eos_id=2) and r.finish == FinishReason.EOS
    r = req(2, new=2)
    r.append(4, None)
    assert r.append(4, None) and r.finish == FinishReason.LENGTH


def test_continuous_batching_respects_slots_and_pages():
    pages = PageAllocator(num_pages=4, page_size=4)  # 16 tokens of KV
    s = Scheduler(max_batch=2, pages=pages)
    for i in range(4):
        s.submit(req(i, n_prompt=5, new=3))  # 8 tokens = 2 pages each
    step = s.schedule()
    assert [r.rid for r in step.prefill] == [0, 1] and step.decode == []
    assert pages.num_promised_pages == 4
    step = s.schedule()
    assert step.prefill == [] and [r.rid for r in step.decode] == [0, 1]
    s.running[0].finish = FinishReason.LENGTH
    assert [r.rid for r in s.retire()] == [0] and pages.num_promised_pages == 2
    step = s.schedule()
    assert [r.rid for r in step.prefill] == [2] and [r.rid for r in step.decode] == [1]
    with pytest.raises(ValueError, match="more KV pages than the whole cache"):
        s.submit(req(9, n_prompt=20, new=1))
    with pytest.raises(ValueError, match="concurrency"):
        Scheduler(0, pages)
