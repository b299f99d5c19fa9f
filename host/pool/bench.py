"""``python -m epick.pool.bench``: the scrape benchmark, kept under the name the README
gives it; the benchmark itself is :mod:`epick.bench.scrape` (benchmarks live in
``epick.bench``, not in the serving package)."""

from epick.bench.scrape import main

if __name__ == "__main__":
    main()
