"""Flow control: requests held in the picker while the pool is saturated, dispatched by priority
band and fairness flow, as llm-d's router does (its `flowControl` feature gate).

- `controller`: the flow controller: capacity at arrival, the wait and its TTLs, the dispatcher;
- `queues`: flow queues, priority bands, the fairness and ordering policies;
- `detectors`: how saturated the pool is (utilization-detector, concurrency-detector);
- `outcomes`: how a held request ends, and the HTTP answer of each end.

It sits between the objective's resolution (extproc/control/director.py `hold`) and scheduling,
which it leaves unchanged: a dispatched request is scheduled then, on the endpoints of that
moment. Its configuration is the EndpointPickerConfig's `flowControl:` section
(extproc/config/flow_control.py); docs/flow-control.md explains it for operators.
"""
