;; A proxy-wasm HTTP filter (ABI 0.2.1) written by hand for the tests: every response gets the header
;; `x-wasm-plugin: <plugin configuration>`, the configuration being the bytes Envoy hands over in
;; proxy_on_configure (a StringValue's text, as istiod's `configuration` carries a WasmPlugin's JSON).
;;
;; Built by `make wasm-filter` (wabt's wat2wasm) into build/wasm/add_header.wasm; see
;; tests/wasm/wasm_filter.py.
;;
;; Memory layout (one 64 KiB page to start, grown by malloc):
;;   16..29     the header name "x-wasm-plugin"
;;   64, 68     where the host writes the pointer and size of a buffer it returns
;;   1024..1535 per root context (id mod 64): configuration pointer, configuration size
;;   2048..6143 per stream context (id mod 1024): its root context id
;;   8192..     the heap: a bump allocator (the host allocates the configuration through malloc)
;; Tables keyed by id modulo their size are enough for a test filter: fewer than 64 plugins per VM
;; and fewer than 1024 streams in flight.
(module
  (import "env" "proxy_get_buffer_bytes"
    (func $get_buffer_bytes (param i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_add_header_map_value"
    (func $add_header_map_value (param i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_log" (func $log (param i32 i32 i32) (result i32)))

  (memory (export "memory") 1)
  (data (i32.const 16) "x-wasm-plugin")
  (data (i32.const 32) "add_header: cannot read the plugin configuration")

  (global $heap (mut i32) (i32.const 8192))

  ;; Buffer and map types, and the log level, of the ABI.
  (global $plugin_configuration i32 (i32.const 7))
  (global $response_headers i32 (i32.const 2))
  (global $log_error i32 (i32.const 4))

  ;; Marks the ABI this module speaks; the host reads it from the export's name.
  (func (export "proxy_abi_version_0_2_1"))

  ;; The host's allocations in this module's memory (8-byte aligned, never freed).
  (func $malloc (export "malloc") (param $size i32) (result i32)
    (local $ptr i32)
    (local $end i32)
    (local.set $ptr (global.get $heap))
    (local.set $end
      (i32.and (i32.add (i32.add (local.get $ptr) (local.get $size)) (i32.const 7)) (i32.const -8)))
    (if (i32.gt_u (local.get $end) (i32.mul (memory.size) (i32.const 65536)))
      (then
        (if (i32.lt_s
              (memory.grow (i32.sub (i32.add (i32.shr_u (local.get $end) (i32.const 16)) (i32.const 1))
                                    (memory.size)))
              (i32.const 0))
          (then (return (i32.const 0))))))
    (global.set $heap (local.get $end))
    (local.get $ptr))

  (func (export "proxy_on_context_create") (param $context i32) (param $parent i32)
    (if (local.get $parent)
      (then
        (i32.store
          (i32.add (i32.const 2048) (i32.shl (i32.and (local.get $context) (i32.const 1023)) (i32.const 2)))
          (local.get $parent)))))

  (func (export "proxy_on_vm_start") (param $root i32) (param $vm_configuration_size i32) (result i32)
    (i32.const 1))

  ;; Keeps the plugin configuration of this root context; an empty one adds an empty header.
  (func (export "proxy_on_configure") (param $root i32) (param $size i32) (result i32)
    (local $slot i32)
    (local.set $slot (i32.add (i32.const 1024) (i32.shl (i32.and (local.get $root) (i32.const 63)) (i32.const 3))))
    (i32.store (local.get $slot) (i32.const 0))
    (i32.store offset=4 (local.get $slot) (i32.const 0))
    (if (i32.eqz (local.get $size)) (then (return (i32.const 1))))
    (if (call $get_buffer_bytes (global.get $plugin_configuration) (i32.const 0) (local.get $size)
                                (i32.const 64) (i32.const 68))
      (then
        (drop (call $log (global.get $log_error) (i32.const 32) (i32.const 48)))
        (return (i32.const 0))))
    (i32.store (local.get $slot) (i32.load (i32.const 64)))
    (i32.store offset=4 (local.get $slot) (i32.load (i32.const 68)))
    (i32.const 1))

  ;; Adds the header with its root context's configuration; Continue (0).
  (func (export "proxy_on_response_headers")
        (param $context i32) (param $headers i32) (param $end_of_stream i32) (result i32)
    (local $root i32)
    (local $slot i32)
    (local.set $root
      (i32.load
        (i32.add (i32.const 2048) (i32.shl (i32.and (local.get $context) (i32.const 1023)) (i32.const 2)))))
    (local.set $slot (i32.add (i32.const 1024) (i32.shl (i32.and (local.get $root) (i32.const 63)) (i32.const 3))))
    (drop (call $add_header_map_value (global.get $response_headers) (i32.const 16) (i32.const 13)
                                      (i32.load (local.get $slot)) (i32.load offset=4 (local.get $slot))))
    (i32.const 0))
)
