//! Fuzzes the YAML configuration decoding (`flame_common::config::parse_str`) of
//! every daemon: flame-osd, flame-mgr and flame-nbd (with the client settings it
//! nests). Input byte 0 picks the daemon and whether the rest is taken as it is or
//! as mutations of the shipped example (`deploy/examples/`). Nothing may panic or
//! hang. Property tests: the `props` module of each `config.rs`.
#![no_main]

use flame_client::nbd::NbdConfig;
use flame_common::config::parse_str;
use flame_common::fuzzing::{mutate, mutations_from};
use flame_mgr::config::MgrConfig;
use flame_osd::config::OsdConfig;
use libfuzzer_sys::fuzz_target;

const EXAMPLES: [&str; 3] = [
    include_str!("../../deploy/examples/osd.yaml"),
    include_str!("../../deploy/examples/mgr.yaml"),
    include_str!("../../deploy/examples/nbd.yaml"),
];

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let which = usize::from(mode % 3);
    let text = if mode & 0x80 != 0 {
        let mut b = EXAMPLES[which].as_bytes().to_vec();
        mutate(&mut b, &mutations_from(rest, 32));
        String::from_utf8_lossy(&b).into_owned()
    } else {
        String::from_utf8_lossy(rest).into_owned()
    };
    match which {
        0 => drop(parse_str::<OsdConfig>(&text, "fuzz")),
        1 => drop(parse_str::<MgrConfig>(&text, "fuzz")),
        _ => drop(parse_str::<NbdConfig>(&text, "fuzz")),
    }
});
