//! Chat text prompts through the real `.wasm`, whose text fast path (`filter/src/request/text.rs`)
//! checks 16 content bytes per Wasm SIMD step, decodes the one-letter escapes itself and
//! declines to serde on `\u` or an odd byte. The same text must make the same prompt blocks
//! whether a body takes the fast path or serde: each case first sends a body whose content
//! spells one character as a `\u` escape (serde, since the fast path declines it), then the
//! same text as the fast path reads it, plain or as a one-letter escape at that offset, which
//! the SIMD step must notice and decode; then the serde body again. The middle request must
//! match exactly as much as the repeat does.

use proxy_wasm_host::{Host, Options, Vm};

use crate::{matched_total, DEBUG_CONFIG as CONFIG};

fn route(vm: &mut Vm, body: &str) -> (u32, u32) {
    matched_total(vm, "/v1/chat/completions", body)
}

fn body(content: &str) -> String {
    format!(
        r#"{{"model":"llama","messages":[{{"role":"system","content":"be brief"}},{{"role":"user","content":"{content}"}}],"max_tokens":8}}"#
    )
}

#[test]
fn the_same_text_makes_the_same_blocks_on_both_paths() {
    let h = Host::filter(Options::default()).expect("load prefix_router.wasm");
    h.set_clock(1_700_000_000_000_000_000);
    let mut vm = h.vm(CONFIG).expect("vm");
    // (as serde reads it, as the fast path or its SIMD step must): an escaped letter vs the
    // letter, `\u` vs one-letter escapes of a newline, a quote and a backslash, and a
    // non-ASCII letter (the SIMD step hands it to the byte loop and UTF-8 check).
    let forms = [
        ("\\u0041", "A"),
        ("\\u000a", "\\n"),
        ("\\u0022", "\\\""),
        ("\\u005c", "\\\\"),
        ("\\u00e9", "é"),
    ];
    let text = "the model cache prefix routing worker token ".repeat(12);
    for (case, at) in (0..40).chain([200, 300, 500]).enumerate() {
        for (k, (serde_form, fast_form)) in forms.iter().enumerate() {
            let head = format!("case {case} form {k} ");
            let (a, b) = text.split_at(at.min(text.len()));
            let serde_body = body(&format!("{head}{a}{serde_form}{b}"));
            let fast_body = body(&format!("{head}{a}{fast_form}{b}"));
            let first = route(&mut vm, &serde_body);
            assert_eq!(first.0, 0, "{case} {k}: first sight");
            let fast = route(&mut vm, &fast_body);
            let again = route(&mut vm, &serde_body);
            assert!(again.0 > 0, "{case} {k}: a repeat matches");
            assert_eq!(fast, again, "{case} {k} at {at}: fast path vs serde");
        }
    }
}
