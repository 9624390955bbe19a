//! Picking a loopback port for a child process to listen on (the end-to-end tests and
//! `specd bench load` start real services on ports chosen this way).
//!
//! Binding port 0 and handing the number on is racy in a way that bites: the kernel takes
//! that port from its ephemeral range, the same range outgoing connections draw their source
//! ports from, so between the pick and the child's bind a connection (a health probe, a
//! client) can take it, and the child fails with "address in use". Ports here come from below
//! the ephemeral range instead, where only explicit binds land, in a per-process sequence
//! from a start that differs between processes, so parallel tests of one process never get
//! the same port and concurrent processes rarely do; each is checked free when picked.

use std::net::{Ipv4Addr, TcpListener};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};

/// The lowest port handed out: above the well-known and common service ports.
const LOWEST: u32 = 10_000;
/// Where the ephemeral range starts when the kernel does not say (Linux's default).
const DEFAULT_EPHEMERAL_START: u32 = 32_768;

/// The first port of the kernel's ephemeral range.
fn ephemeral_start() -> u32 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse().ok())
        .unwrap_or(DEFAULT_EPHEMERAL_START)
}

/// A loopback port nothing listens on now, outside the ephemeral range where it can (see the
/// module documentation); falls back to the kernel's pick if that range leaves no room.
pub fn free_local_port() -> std::io::Result<u16> {
    static START: OnceLock<(u32, u32)> = OnceLock::new();
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let (highest, start) = *START.get_or_init(|| {
        let highest = ephemeral_start().min(u32::from(u16::MAX));
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        (highest, std::process::id().wrapping_mul(7919).wrapping_add(nanos))
    });
    if highest > LOWEST {
        let span = highest - LOWEST;
        for _ in 0..span.min(1000) {
            let port = LOWEST + start.wrapping_add(NEXT.fetch_add(1, Ordering::Relaxed)) % span;
            let port = u16::try_from(port).expect("below the ephemeral range");
            if TcpListener::bind((Ipv4Addr::LOCALHOST, port)).is_ok() {
                return Ok(port);
            }
        }
    }
    Ok(TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?.local_addr()?.port())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_distinct_free_and_below_the_ephemeral_range() {
        let ports: Vec<u16> = (0..200).map(|_| free_local_port().unwrap()).collect();
        let distinct: std::collections::HashSet<_> = ports.iter().collect();
        assert_eq!(distinct.len(), ports.len(), "a port was handed out twice");
        let start = ephemeral_start();
        if start > LOWEST {
            assert!(
                ports
                    .iter()
                    .all(|&p| u32::from(p) >= LOWEST && u32::from(p) < start),
                "{ports:?} outside {LOWEST}..{start}"
            );
        }
        for port in &ports[..5] {
            TcpListener::bind((Ipv4Addr::LOCALHOST, *port)).expect("the port is free");
        }
    }
}
