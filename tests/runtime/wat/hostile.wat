;; A policy that passes vetting and turns hostile in service. score misbehaves
;; ({{score_bad}}) only for requests whose model starts with "H" (the smoke run asks
;; for "base-model"); pre_request ({{pre_bad}}) only once the event's timestamp is past
;; 2024 (the smoke run's clock is 2023, the service's is now). init runs {{init_loops}}
;; empty loop rounds first (a slow start). Otherwise it scores 0.5 everywhere.
(module
  ;; @include _abi.wat
  ;; @include _msgpack.wat
  (global $calls (mut i32) (i32.const 0))
  (data (i32.const 16) "every other call")
  (table $t 1 funcref)

  (func (export "init") (param i32 i32) (result i32)
    (local $n i32)
    (local.set $n (i32.const {{init_loops}}))
    (block $done (loop $l
      (br_if $done (i32.eqz (local.get $n)))
      (local.set $n (i32.sub (local.get $n) (i32.const 1)))
      (br $l)))
    (i32.const 0))

  ;; the first byte of ScoreInput.request.model ([snapshot, [id, model, ...], candidates])
  (func $model0 (param $in i32) (result i32)
    (local $p i32) (local $b i32)
    (local.set $p (call $skip (i32.add (local.get $in) (i32.const 1))))
    (local.set $p (call $skip (i32.add (local.get $p) (i32.const 1))))  ;; request_id
    (local.set $b (i32.load8_u (local.get $p)))
    (if (i32.eq (local.get $b) (i32.const 0xd9))
      (then (return (i32.load8_u offset=2 (local.get $p)))))
    (i32.load8_u offset=1 (local.get $p)))

  (func (export "score") (param $in i32) (param $len i32) (param $out i32) (result i32)
    (local $n i32)  ;; free for score_bad
    (global.set $calls (i32.add (global.get $calls) (i32.const 1)))
    (if (i32.eq (call $model0 (local.get $in)) (i32.const 0x48)) (then {{score_bad}}))
    (call $fill (local.get $out) (call $candidates (local.get $in)) (f64.const 0.5))
    (i32.const 0))

  ;; PreRequestEvent = [request, endpoint, timestamp_ms]; the high word of a uint64 ms
  ;; timestamp is >= 400 from mid-2024 on.
  (func (export "pre_request") (param $in i32) (param $len i32) (result i32)
    (local $p i32)
    (local.set $p (call $skip (call $skip (i32.add (local.get $in) (i32.const 1)))))
    (if (i32.and (i32.eq (i32.load8_u (local.get $p)) (i32.const 0xcf))
                 (i32.ge_u (call $be32 (i32.add (local.get $p) (i32.const 1))) (i32.const 400)))
      (then {{pre_bad}}))
    (i32.const 0))
)
