"""Load against a router: open-loop trace replay and its report (`exitplan bench`).

- `texts`: held-out texts matched to a trace's input lengths, with the full model's reference answers;
- `loadgen`: the open-loop sender; every request ends as one classified `Outcome`;
- `report`: the arithmetic from outcomes to a `BenchReport` (goodput, percentiles, exits, agreement, errors);
- `capacity`: the capacity within an SLO (the highest rate at which >= 99 % of requests finish within it,
  over a step and its last third), searched by doubling then bisecting;
- `bench`: `run_bench` / `run_bench_async` / `find_capacity`, the API `exitplan bench` and `exitplan demo` call.
"""
