//! Fuzzes the agent protocol's decoders: request frames (protocol 1 and 2/3 framing) and answer frames.
//!
//! The first byte picks what the rest is (0: a protocol 1 request payload, 1: a protocol 2 or 3
//! request payload (one framing), 2: an answer payload; the 4-byte length prefix is not included). Decoding
//! never panics nor aborts (a length claiming more than the frame holds is an error, not an
//! allocation); whatever decodes encodes back to a frame that decodes to the same value.
#![no_main]

use backend_agent::protocol::{
    decode_payload, decode_request, encode_frame, BoundedRequestFrame, RequestFrame,
    ResponseFrame, MAX_REQUEST_BYTES, MAX_RESPONSE_BYTES, PROTOCOL_V1, PROTOCOL_VERSION,
};
use libfuzzer_sys::fuzz_target;

/// The length prefix in front of every frame's payload.
const PREFIX: usize = 4;

fn request_round_trip(payload: &[u8], protocol: u32) {
    let Ok(request) = decode_request(payload, protocol) else {
        return;
    };
    let frame = match request.deadline {
        Some(deadline) => encode_frame(
            &BoundedRequestFrame {
                id: request.id,
                deadline,
                request: request.request.clone(),
            },
            MAX_REQUEST_BYTES,
        ),
        None => encode_frame(
            &RequestFrame {
                id: request.id,
                request: request.request.clone(),
            },
            MAX_REQUEST_BYTES,
        ),
    }
    .expect("a decoded request encodes again");
    let again = decode_request(&frame[PREFIX..], protocol).expect("re-encoded request decodes");
    assert_eq!(again, request, "decode(encode(x)) != x");
}

fn response_round_trip(payload: &[u8]) {
    let Ok(response) = decode_payload::<ResponseFrame>(payload) else {
        return;
    };
    let frame = encode_frame(&response, MAX_RESPONSE_BYTES).expect("a decoded answer encodes");
    let again: ResponseFrame =
        decode_payload(&frame[PREFIX..]).expect("re-encoded answer decodes");
    assert_eq!(again, response, "decode(encode(x)) != x");
}

fuzz_target!(|data: &[u8]| {
    let Some((&kind, payload)) = data.split_first() else {
        return;
    };
    match kind % 3 {
        0 => request_round_trip(payload, PROTOCOL_V1),
        1 => request_round_trip(payload, PROTOCOL_VERSION),
        _ => response_round_trip(payload),
    }
});
