//! The one mapping of a [`ReplicaError`] to the wire and back: to a gRPC
//! status for the replica service's control calls ([`to_status`],
//! [`from_status`]) and to a refusal frame for the block channel
//! ([`to_refusal`], [`from_refusal`]). The servers of [`super::serve`] send
//! with it, the client of [`super::peer`] reads with it, so an error means
//! the same on every path; a refusal the replica did not make on purpose
//! means the replica is unavailable for that request.
//!
//! | replica error | gRPC code | block-channel code, figures in the header |
//! |---|---|---|
//! | stale term | `FAILED_PRECONDITION`, "stale term", floor in `x-fence-floor` | `StaleTerm`, floor in the stamp's `term` |
//! | stale generation | `FAILED_PRECONDITION`, "stale generation", floor in `x-fence-floor` and `x-fence-generation` | `StaleGeneration`, floor in the stamp |
//! | term 0 | `INVALID_ARGUMENT` | `InvalidTerm` |
//! | invalid request | `INVALID_ARGUMENT` | `InvalidRequest` |
//! | request too large | `INVALID_ARGUMENT`, `x-range-len`, `x-range-max` | `TooLarge`, length in `length`, maximum in `offset` |
//! | out of range | `OUT_OF_RANGE`, `x-range-offset`, `x-range-len`, `x-range-size` | `OutOfRange`, `offset`, `length`, volume size in the stamp's `generation` |
//! | identity mismatch, invalid identity | `FAILED_PRECONDITION` | `IdentityMismatch` |
//! | no copy of the volume on that node, or a copy of another group (sent by the service itself) | `NOT_FOUND` | `IdentityMismatch` |
//! | unavailable; restarted (found by the writer, never sent) | `UNAVAILABLE` | `Unavailable` |
//! | disk or metadata I/O | `INTERNAL` | `Io` |
//!
//! Back on the client every refusal becomes the same error again (a range
//! refusal keeps its figures).
//!
//! A writer's [`Stamp`] crosses the wire as two numbers, `term` and
//! `generation`: in the frame header (as a `Stamp` field of
//! [`Header`]) and in the replica service's stamped requests, whose one
//! conversion each way is [`Stamped`]. The numbers, and so the bytes on
//! the wire, are those of earlier builds: nodes of both can talk during a
//! rolling restart.

use bytes::Bytes;
use tonic::metadata::MetadataValue;
use tonic::{Code, Status};

use super::{ReplicaError, Stamp};
use crate::ids::{Incarnation, Term};
use crate::net::frame::{ErrorCode, Frame, Header, Kind};
use crate::proto::replica as pb;
use crate::volume::RangeError;

/// A replica-service request that carries a writer's [`Stamp`] in its
/// `term` and `generation` fields.
pub trait Stamped: Sized {
    /// The stamp the request carries.
    fn stamp(&self) -> Stamp;
    /// The request, stamped with `stamp`.
    fn stamped(self, stamp: Stamp) -> Self;
}

macro_rules! stamped {
    ($($message:ty),+) => {
        $(impl Stamped for $message {
            fn stamp(&self) -> Stamp {
                Stamp {
                    term: Term(self.term),
                    generation: self.generation,
                }
            }
            fn stamped(self, stamp: Stamp) -> Self {
                Self {
                    term: stamp.term.0,
                    generation: stamp.generation,
                    ..self
                }
            }
        })+
    };
}

stamped!(
    pb::GrowRequest,
    pb::RetireMarksRequest,
    pb::NoteMissedRequest,
    pb::SetUnverifiedRequest,
    pb::CloseMissedRequest
);

/// The metadata key that carries a replica's fence floor on a stale-term
/// refusal.
pub const FLOOR_KEY: &str = "x-fence-floor";

/// The metadata key that carries the floor's generation on a
/// stale-generation refusal.
pub const GENERATION_KEY: &str = "x-fence-generation";

/// The metadata keys that carry a range refusal's figures, so the client
/// gets the same [`RangeError`] back.
const RANGE_OFFSET_KEY: &str = "x-range-offset";
const RANGE_LEN_KEY: &str = "x-range-len";
const RANGE_SIZE_KEY: &str = "x-range-size";
const RANGE_MAX_KEY: &str = "x-range-max";

fn with_numbers(mut status: Status, numbers: &[(&'static str, u64)]) -> Status {
    for (key, value) in numbers {
        if let Ok(value) = MetadataValue::try_from(value.to_string()) {
            status.metadata_mut().insert(*key, value);
        }
    }
    status
}

/// Maps a replica error to a gRPC status (see the module table).
pub fn to_status(err: &ReplicaError) -> Status {
    let message = err.to_string();
    match err {
        ReplicaError::StaleTerm { floor, .. } => with_numbers(
            Status::failed_precondition(message),
            &[(FLOOR_KEY, floor.0)],
        ),
        ReplicaError::StaleGeneration { floor, .. } => with_numbers(
            Status::failed_precondition(message),
            &[
                (FLOOR_KEY, floor.term.0),
                (GENERATION_KEY, floor.generation),
            ],
        ),
        ReplicaError::InvalidTerm | ReplicaError::InvalidRequest(_) => {
            Status::invalid_argument(message)
        }
        ReplicaError::Range(RangeError::TooLarge { len, max }) => with_numbers(
            Status::invalid_argument(message),
            &[(RANGE_LEN_KEY, *len), (RANGE_MAX_KEY, *max)],
        ),
        ReplicaError::Range(RangeError::OutOfRange { offset, len, size }) => with_numbers(
            Status::out_of_range(message),
            &[
                (RANGE_OFFSET_KEY, *offset),
                (RANGE_LEN_KEY, *len),
                (RANGE_SIZE_KEY, *size),
            ],
        ),
        ReplicaError::IdentityMismatch(_) | ReplicaError::InvalidIdentity(_) => {
            Status::failed_precondition(message)
        }
        ReplicaError::Unavailable(_) | ReplicaError::Restarted(_) => Status::unavailable(message),
        ReplicaError::Io(_) => Status::internal(message),
    }
}

/// Maps a gRPC status from a replica back to a replica error. Anything that
/// is not a refusal the replica made on purpose counts as the replica being
/// unavailable for this request.
pub fn from_status(status: &Status, stamp: impl Into<Stamp>) -> ReplicaError {
    let stamp = stamp.into();
    let number = |key: &str| -> Option<u64> {
        status
            .metadata()
            .get(key)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok())
    };
    let floor = number(FLOOR_KEY).map(Term);
    match (status.code(), floor, number(GENERATION_KEY)) {
        (Code::FailedPrecondition, Some(term), Some(generation)) => ReplicaError::StaleGeneration {
            stamp,
            floor: Stamp { term, generation },
        },
        (Code::FailedPrecondition, Some(floor), None) => ReplicaError::StaleTerm {
            term: stamp.term,
            floor,
        },
        (Code::OutOfRange, ..) => match (
            number(RANGE_OFFSET_KEY),
            number(RANGE_LEN_KEY),
            number(RANGE_SIZE_KEY),
        ) {
            (Some(offset), Some(len), Some(size)) => {
                ReplicaError::Range(RangeError::OutOfRange { offset, len, size })
            }
            // Not a range refusal of the replica's own (a transport limit).
            _ => ReplicaError::Io(format!("refused: {}", status.message())),
        },
        (Code::InvalidArgument, ..) => match (number(RANGE_LEN_KEY), number(RANGE_MAX_KEY)) {
            (Some(len), Some(max)) => ReplicaError::Range(RangeError::TooLarge { len, max }),
            _ => ReplicaError::InvalidRequest(status.message().to_string()),
        },
        (Code::FailedPrecondition, None, _) | (Code::PermissionDenied | Code::NotFound, ..) => {
            ReplicaError::IdentityMismatch(status.message().to_string())
        }
        _ => ReplicaError::Unavailable(format!("{}: {}", status.code(), status.message())),
    }
}

/// Why a request meant for incarnation `asked` of this node's replica is
/// refused by incarnation `ours` (S8).
pub fn replaced_disk(ours: Incarnation, asked: Incarnation) -> String {
    format!(
        "replaced disk: this replica is incarnation {ours}, not {asked}; it holds no \
         acknowledged write until a membership change names it and a full resync has \
         rebuilt it"
    )
}

/// The refusal frame (a reply to request `id`) for `err`.
pub fn to_refusal(id: u64, err: &ReplicaError) -> Frame {
    let mut header = Header::new(Kind::Refused, id);
    let code = match err {
        ReplicaError::StaleTerm { floor, .. } => {
            header.stamp = Stamp::from(*floor);
            ErrorCode::StaleTerm
        }
        ReplicaError::StaleGeneration { floor, .. } => {
            header.stamp = *floor;
            ErrorCode::StaleGeneration
        }
        ReplicaError::InvalidTerm => ErrorCode::InvalidTerm,
        ReplicaError::InvalidRequest(_) => ErrorCode::InvalidRequest,
        ReplicaError::Range(RangeError::TooLarge { len, max }) => {
            header.length = *len;
            header.offset = *max;
            ErrorCode::TooLarge
        }
        ReplicaError::Range(RangeError::OutOfRange { offset, len, size }) => {
            header.offset = *offset;
            header.length = *len;
            header.stamp.generation = *size;
            ErrorCode::OutOfRange
        }
        ReplicaError::IdentityMismatch(_) | ReplicaError::InvalidIdentity(_) => {
            ErrorCode::IdentityMismatch
        }
        ReplicaError::Unavailable(_) | ReplicaError::Restarted(_) => ErrorCode::Unavailable,
        ReplicaError::Io(_) => ErrorCode::Io,
    };
    header.flags = code as u16;
    Frame::new(header, Bytes::from(err.to_string()))
}

/// The replica error a refusal frame stands for, for a request stamped
/// `stamp`.
pub fn from_refusal(refusal: &Frame, stamp: impl Into<Stamp>) -> ReplicaError {
    let stamp = stamp.into();
    let h = &refusal.header;
    let message = String::from_utf8_lossy(&refusal.payload).into_owned();
    match ErrorCode::of(h.flags) {
        ErrorCode::StaleTerm => ReplicaError::StaleTerm {
            term: stamp.term,
            floor: h.stamp.term,
        },
        ErrorCode::StaleGeneration => ReplicaError::StaleGeneration {
            stamp,
            floor: h.stamp,
        },
        ErrorCode::InvalidTerm => ReplicaError::InvalidTerm,
        ErrorCode::InvalidRequest => ReplicaError::InvalidRequest(message),
        ErrorCode::TooLarge => ReplicaError::Range(RangeError::TooLarge {
            len: h.length,
            max: h.offset,
        }),
        ErrorCode::OutOfRange => ReplicaError::Range(RangeError::OutOfRange {
            offset: h.offset,
            len: h.length,
            size: h.stamp.generation,
        }),
        ErrorCode::IdentityMismatch => ReplicaError::IdentityMismatch(message),
        ErrorCode::Unavailable => ReplicaError::Unavailable(message),
        ErrorCode::Io => ReplicaError::Io(message),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_refusal_comes_back_as_the_same_error_over_grpc() {
        for (err, stamp) in sample_refusals() {
            let back = from_status(&to_status(&err), stamp);
            match (&err, &back) {
                // The message comes back inside gRPC's own wording.
                (ReplicaError::Unavailable(_), ReplicaError::Unavailable(_))
                | (ReplicaError::InvalidRequest(_), ReplicaError::InvalidRequest(_)) => {}
                _ => assert_eq!(back, err),
            }
        }
    }

    #[test]
    fn every_refusal_comes_back_as_the_same_error_over_the_block_channel() {
        let more = [
            (ReplicaError::InvalidTerm, Stamp::term(Term(1))),
            (ReplicaError::Io("disk".into()), Stamp::term(Term(1))),
        ];
        for (err, stamp) in sample_refusals().into_iter().chain(more) {
            let refusal = to_refusal(9, &err);
            assert_eq!(refusal.header.id, 9);
            let back = from_refusal(&refusal, stamp);
            match (&err, &back) {
                // The message comes back as the replica worded it.
                (ReplicaError::InvalidRequest(_), ReplicaError::InvalidRequest(m))
                | (ReplicaError::Unavailable(_), ReplicaError::Unavailable(m))
                | (ReplicaError::Io(_), ReplicaError::Io(m)) => assert_eq!(*m, err.to_string()),
                _ => assert_eq!(back, err),
            }
        }
    }

    /// One refusal of each kind a replica sends on purpose, and the stamp of
    /// the request each answers: for the tests that every transport brings
    /// them back as the same error.
    fn sample_refusals() -> Vec<(ReplicaError, Stamp)> {
        use crate::volume::RangeError;
        let stale = Stamp {
            term: Term(5),
            generation: 1,
        };
        vec![
            (
                ReplicaError::StaleTerm {
                    term: Term(3),
                    floor: Term(5),
                },
                Stamp::term(Term(3)),
            ),
            (
                ReplicaError::StaleGeneration {
                    stamp: stale,
                    floor: Stamp {
                        term: Term(5),
                        generation: 2,
                    },
                },
                stale,
            ),
            (
                ReplicaError::Range(RangeError::OutOfRange {
                    offset: 4096,
                    len: 512,
                    size: 4096,
                }),
                Stamp::term(Term(1)),
            ),
            (
                ReplicaError::Range(RangeError::TooLarge {
                    len: 64 << 20,
                    max: 32 << 20,
                }),
                Stamp::term(Term(1)),
            ),
            (
                ReplicaError::InvalidRequest("bad".into()),
                Stamp::term(Term(1)),
            ),
            (
                ReplicaError::Unavailable("gone".into()),
                Stamp::term(Term(1)),
            ),
        ]
    }
}
