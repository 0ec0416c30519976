//! The ranks' agreement on a step that every rank takes or none does (a save, a load, an
//! import): each rank first does everything that can fail without changing its state, then
//! the ranks exchange their outcomes; all go on, or every rank returns an error: a failing rank
//! its own, the others the lowest failing rank's ([`Error::PeerRefused`]). One small exchange
//! when every rank succeeded; a second carries the failure's message.

use std::path::Path;
use std::sync::Arc;

use super::Engine;
use crate::backend::Backend;
use crate::checkpoint::SaveId;
use crate::comm::{Communicator, Purpose};
use crate::error::{Error, Result};

/// What each rank proposes with its outcome (a save's id, say).
pub(super) type Proposal = [u8; 16];

/// Bytes of a failure's message in the second exchange.
const MESSAGE_BYTES: usize = 2048;

impl<B: Backend, C: Communicator<B>> Engine<B, C> {
    /// Exchanges `outcome` with every rank of the grid (every replica's too): `Ok` with the
    /// value and every rank's proposal, in rank order, when every rank succeeded. `dir` names
    /// what the ranks act on, for a peer's failure of a kind no message carries whole. A
    /// failure of the exchange itself poisons the engine.
    pub(super) fn agree<T>(
        &mut self,
        dir: &Path,
        outcome: Result<(T, Proposal)>,
    ) -> Result<(T, Vec<Proposal>)> {
        self.agree_undoing(dir, outcome, || {})
    }

    /// As [`Engine::agree`], with `undo` run on a rank that succeeded where another failed,
    /// before the ranks exchange the failure's message: every rank's `undo` is done when any
    /// rank returns.
    pub(super) fn agree_undoing<T>(
        &mut self,
        dir: &Path,
        outcome: Result<(T, Proposal)>,
        undo: impl FnOnce(),
    ) -> Result<(T, Vec<Proposal>)> {
        if self.comm.grid_size() == 1 {
            return outcome.map(|(value, proposal)| (value, vec![proposal]));
        }
        let mut record = [0u8; 1 + 16];
        match &outcome {
            Ok((_, proposal)) => record[1..].copy_from_slice(proposal),
            Err(_) => record[0] = 1,
        }
        let exchanged = self.exchange(Purpose::Agreement, &record, true);
        let records = self.observe(exchanged)?;
        let failed = records.iter().position(|r| r.first() != Some(&0));
        let Some(rank) = failed else {
            let (value, _) = outcome?;
            let proposals = records
                .iter()
                .map(|r| {
                    let mut p = [0u8; 16];
                    p.copy_from_slice(&r[1..]);
                    p
                })
                .collect();
            return Ok((value, proposals));
        };
        let message = match &outcome {
            Err(e) => encode(e),
            Ok(_) => {
                undo();
                vec![0; MESSAGE_BYTES]
            }
        };
        let exchanged = self.exchange(Purpose::Agreement, &message, true);
        let messages = self.observe(exchanged)?;
        match outcome {
            Err(own) => Err(own),
            Ok(_) => Err(Error::PeerRefused {
                rank,
                cause: Box::new(decode(&messages[rank], dir)),
            }),
        }
    }
}

/// Refuses, alike on every rank, `proposals` (every rank's, in rank order) that are not all
/// the first rank's: the ranks read different sources (`what`, e.g. "saves": node-local copies
/// of two checkpoints), each named by its proposal's hex digits.
pub(super) fn check_one_source(proposals: &[Proposal], what: &str) -> Result<()> {
    /// Ranks named before the rest are counted.
    const NAMED: usize = 4;
    let Some(first) = proposals.first() else {
        return Ok(());
    };
    let hex = |p: &Proposal| SaveId(*p).to_hex();
    let others: Vec<usize> = (0..proposals.len())
        .filter(|&r| proposals[r] != *first)
        .collect();
    if others.is_empty() {
        return Ok(());
    }
    let mut differences: Vec<String> = others
        .iter()
        .take(NAMED)
        .map(|&r| {
            format!(
                "the ranks read different {what}: rank 0 {}, rank {r} {}",
                hex(first),
                hex(&proposals[r])
            )
        })
        .collect();
    if others.len() > NAMED {
        differences.push(format!("and {} more ranks", others.len() - NAMED));
    }
    Err(Error::CheckpointMismatch { differences })
}

/// What kind of error a message carries, as its first byte.
const UNREADABLE: u8 = 1;
const MISMATCH: u8 = 2;
const EXISTS: u8 = 3;
const OUT_OF_MEMORY: u8 = 4;
const WRITE: u8 = 5;
const EMPTY_PATH: u8 = 6;
const SAVE_PENDING: u8 = 7;
const TIMEOUT: u8 = 8;
const PANICKED: u8 = 9;
const OTHER: u8 = 255;

/// `e` as [`MESSAGE_BYTES`] bytes: its kind, then its fields, each ended by a NUL (cut at the
/// end where too long).
fn encode(e: &Error) -> Vec<u8> {
    let (kind, fields): (u8, Vec<String>) = match e {
        Error::CheckpointUnreadable { path, reason } => {
            (UNREADABLE, vec![path.clone(), reason.clone()])
        }
        Error::CheckpointMismatch { differences } => (MISMATCH, differences.clone()),
        Error::CheckpointExists { path } => (EXISTS, vec![path.clone()]),
        Error::OutOfMemory { bytes, what } => {
            (OUT_OF_MEMORY, vec![bytes.to_string(), what.clone()])
        }
        Error::Write { path, source } => (WRITE, vec![path.clone(), source.to_string()]),
        Error::EmptyPath { what } => (EMPTY_PATH, vec![what.clone()]),
        Error::SavePending { dir } => (SAVE_PENDING, vec![dir.clone()]),
        Error::Timeout { op, waited } => (TIMEOUT, vec![op.clone(), waited.as_nanos().to_string()]),
        Error::Panicked { message } => (PANICKED, vec![message.clone()]),
        other => (OTHER, vec![other.to_string()]),
    };
    let mut out = vec![0u8; MESSAGE_BYTES];
    out[0] = kind;
    let mut at = 1;
    for field in fields {
        let room = MESSAGE_BYTES.saturating_sub(at + 1);
        let cut = (0..=room.min(field.len()))
            .rev()
            .find(|&i| field.is_char_boundary(i))
            .unwrap_or(0);
        out[at..at + cut].copy_from_slice(&field.as_bytes()[..cut]);
        at += cut + 1;
        if at >= MESSAGE_BYTES {
            break;
        }
    }
    out
}

/// The error [`encode`] wrote into `bytes`; one of a kind that no message carries whole reads
/// as a checkpoint at `dir` that could not be used.
fn decode(bytes: &[u8], dir: &Path) -> Error {
    let kind = bytes.first().copied().unwrap_or(OTHER);
    let body = bytes.get(1..).unwrap_or_default();
    let end = body.iter().rposition(|&b| b != 0).map_or(0, |i| i + 1);
    let fields: Vec<String> = body[..end]
        .split(|&b| b == 0)
        .map(|f| String::from_utf8_lossy(f).into_owned())
        .collect();
    let field = |i: usize| fields.get(i).cloned().unwrap_or_default();
    match kind {
        UNREADABLE => Error::CheckpointUnreadable {
            path: field(0),
            reason: field(1),
        },
        MISMATCH => Error::CheckpointMismatch {
            differences: fields,
        },
        EXISTS => Error::CheckpointExists { path: field(0) },
        OUT_OF_MEMORY => Error::OutOfMemory {
            bytes: field(0).parse().unwrap_or(0),
            what: field(1),
        },
        WRITE => Error::Write {
            path: field(0),
            source: Arc::new(std::io::Error::other(field(1))),
        },
        EMPTY_PATH => Error::EmptyPath { what: field(0) },
        SAVE_PENDING => Error::SavePending { dir: field(0) },
        TIMEOUT => Error::Timeout {
            op: field(0),
            waited: std::time::Duration::from_nanos(field(1).parse().unwrap_or(0)),
        },
        PANICKED => Error::Panicked { message: field(0) },
        _ => Error::CheckpointUnreadable {
            path: dir.display().to_string(),
            reason: field(0),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failure_crosses_to_the_other_ranks_as_the_same_error() {
        let dir = Path::new("ckpt");
        let cases = [
            Error::CheckpointUnreadable {
                path: "ckpt/rank-00002.bin".into(),
                reason: "corrupted: chunk 3".into(),
            },
            Error::CheckpointMismatch {
                differences: vec!["\"a\" is not in the checkpoint".into(), "b: é".into()],
            },
            Error::CheckpointExists {
                path: "ckpt/rank-00000.json".into(),
            },
            Error::OutOfMemory {
                bytes: 12345,
                what: "the checkpoint's state".into(),
            },
            Error::EmptyPath { what: "dir".into() },
            Error::SavePending { dir: "ckpt".into() },
            Error::Timeout {
                op: "the save into ckpt".into(),
                waited: std::time::Duration::from_millis(1500),
            },
            Error::Panicked {
                message: "the save into ckpt panicked".into(),
            },
        ];
        for e in cases {
            assert_eq!(decode(&encode(&e), dir).to_string(), e.to_string());
        }
        let write = Error::Write {
            path: "ckpt".into(),
            source: Arc::new(std::io::Error::other("disk full")),
        };
        assert_eq!(decode(&encode(&write), dir).to_string(), write.to_string());
        let other = decode(&encode(&Error::Aborted), dir);
        assert!(
            matches!(&other, Error::CheckpointUnreadable { path, reason }
                if path == "ckpt" && reason == "the engine was aborted"),
            "{other:?}"
        );
    }

    #[test]
    fn ranks_of_different_sources_are_each_named_and_counted_past_a_few() {
        let (a, b) = ([1u8; 16], [2u8; 16]);
        assert!(check_one_source(&[a, a, a], "saves").is_ok());
        assert!(check_one_source(&[], "saves").is_ok());
        let Err(Error::CheckpointMismatch { differences }) = check_one_source(&[a, b, a], "saves")
        else {
            panic!("not refused");
        };
        let (ha, hb) = ("01".repeat(16), "02".repeat(16));
        assert_eq!(
            differences,
            [format!(
                "the ranks read different saves: rank 0 {ha}, rank 1 {hb}"
            )]
        );
        let mut many = vec![a];
        many.extend([b; 7]);
        let Err(Error::CheckpointMismatch { differences }) = check_one_source(&many, "files")
        else {
            panic!("not refused");
        };
        assert_eq!(differences.len(), 5);
        assert!(differences[3].ends_with(&format!("rank 4 {hb}")));
        assert_eq!(differences[4], "and 3 more ranks");
    }

    #[test]
    fn a_long_message_is_cut_at_a_character() {
        let e = Error::CheckpointMismatch {
            differences: vec!["é".repeat(MESSAGE_BYTES)],
        };
        let bytes = encode(&e);
        assert_eq!(bytes.len(), MESSAGE_BYTES);
        let Error::CheckpointMismatch { differences } = decode(&bytes, Path::new("d")) else {
            panic!("not a mismatch");
        };
        assert!(differences[0].chars().all(|c| c == 'é'));
        assert!(differences[0].len() > MESSAGE_BYTES - 8);
    }
}
