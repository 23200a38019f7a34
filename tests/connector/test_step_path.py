"""The traced scheduler's per-step path (issue 18's cheaper one) describes each step's batch as the kinds rule says.

A request's ``step.batch`` entry is ``X:d1`` when it decodes one token; the entry is cached once the
request decodes (``SReq.dtag``) and must not hide a later change of kind: a preempted request that
recomputes its prompt is ``r``, then ``d1`` again. The scheduler is built without vLLM's ``__init__``
(the attributes its hooks read); the metadata and outputs are vLLM's own classes; the recorder is real
and the rows are read back from the store.
"""
import json


def test_decode_entries_are_cached_but_a_preempted_request_recomputes(tmp_path, child):
    r = child(f"""
        import collections, glob, json, types, pyarrow.parquet as pq
        from pdtrace.instrument import activate, tracer
        from pdtrace.connector.traced.pull import TracedNixlPullConnectorScheduler as S
        from pdtrace.connector.traced.scheduler import SReq
        from pdtrace.connector.traced.messages import StepReport
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata
        from vllm.v1.outputs import KVConnectorOutput
        assert activate("explicit")
        s = object.__new__(S)
        s._pdt_role, s._pdt_step_name, s._pdt_tp, s._pdt_mode = "decode", "decode.step", 1, "pull"
        s._pdt_reqs, s._pdt_pending, s._pdt_step_id = {{}}, collections.deque(), 0
        s._pdt_holds, s._pdt_expired, s._pdt_idle, s._pdt_cpu_mark = {{}}, set(), 0, None
        reqs = {{}}
        for x in ("cmpl-A1-0-0123abcd", "cmpl-B2-0-0123abcd"):
            req = types.SimpleNamespace(request_id=x, num_prompt_tokens=8, num_computed_tokens=8,
                                        arrival_time=None)
            st = s._pdt_reqs[x] = SReq(req, "decode")
            st.t_alloc = tracer.now()
            reqs[x] = req
        a, b = reqs

        def step(sched, preempted=()):
            meta = NixlConnectorMetadata()
            so = types.SimpleNamespace(num_scheduled_tokens=sched, preempted_req_ids=set(preempted))
            s._pdt_step_start(so, meta, tracer.now())
            for rid, n in sched.items():
                reqs[rid].num_computed_tokens += n
            s._pdt_step_end(KVConnectorOutput(kv_connector_worker_meta=StepReport(meta._pdtrace.step),
                                              finished_recving=set(), finished_sending=set(),
                                              failed_recving=set()), tracer.now())
        step({{a: 1, b: 1}})
        step({{a: 1, b: 1}})                      # both cached now
        reqs[b].num_computed_tokens = 0          # vLLM preempted B: its KV is gone
        step({{a: 1}}, preempted=[b])
        step({{a: 1, b: 8}})                      # B recomputes its prompt (and one more) in one chunk
        step({{a: 1, b: 1}})                      # and decodes again
        step({{a: 2, b: 1}})                      # two tokens for A (no cached entry for that)
        tracer.shutdown()
        rows = [r for f in glob.glob("{tmp_path}/*.parquet") for r in pq.read_table(f).to_pylist()]
        steps = sorted((dict(r["attr_int"])["step.id"], dict(r["attr_str"])["step.batch"],
                        dict(r["attr_int"])["step.decode_tokens"], dict(r["attr_int"])["step.recompute_tokens"])
                       for r in rows if r["record"] == "span" and r["name"] == "decode.step")
        print(json.dumps(steps))
    """, env={"PDTRACE_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-2000:]
    steps = json.loads(r.stdout.strip().splitlines()[-1])
    assert steps == [[0, "A1:d1;B2:d1", 2, 0], [1, "A1:d1;B2:d1", 2, 0], [2, "A1:d1", 1, 0],
                     [3, "A1:d1;B2:r8", 1, 8], [4, "A1:d1;B2:d1", 2, 0], [5, "A1:d2;B2:d1", 3, 0]]
