"""The command line and the applications behind it: ``devmesh show | plan | doctor | bench |
run | demo`` (:mod:`.cli`), cluster planning, health checks, collective benchmarks, and the
digits training used by the demo and examples."""
