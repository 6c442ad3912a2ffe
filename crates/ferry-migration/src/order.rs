//! The order of messages, as pure state machines: [`DestinationOrder`]
//! checks what a destination receives from a source, [`SourceOrder`] what a
//! source receives from a destination (given what it sent). Each answers
//! every message with "fine" or a [`ProtocolViolation`]; the engines feed
//! them before acting on a message, so a peer that skips a step (Data
//! before Hello, Switch without a Digest, Synced for a round never ended)
//! is stopped at the first wrong message instead of being half-served.
//!
//! ```text
//! destination:  Greeting --Hello--> Prints --PrintsDone--> Transfer
//!                  |                  | Prints, Data         | Data, RoundEnd(0, 1, 2, ...)
//!                  |Lookup            |                      | Pause (after RoundEnd 0)
//!                  v                  v                      v
//!               Buddy (Lookup)*                            Paused --Digest--> Verifying --Switch--> Switched
//!                                                            | Data
//! Abort is accepted in every state but Switched and ends the conversation.
//!
//! source:       AwaitWelcome --Welcome--> Prints --WantDone--> Rounds --(sent Digest)--> Verdict
//!                  | Done only if a switch was pending     | Want            | Synced(n) for each RoundEnd(n) sent
//!                  | Refuse ends it                                          DigestResult, then Done after Switch
//!               after Welcome: Pong(n) for each Ping(n) sent, in order
//! destination:  Ping in Prints and Transfer (answered with Pong; the state stays)
//! ```

use crate::message::{Message, MessageType};
use thiserror::Error;

/// A message that may not come now.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{got} is not allowed {state}")]
pub struct ProtocolViolation {
    pub got: &'static str,
    pub state: &'static str,
}

/// Where a destination is in one conversation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DestinationState {
    /// Nothing received yet.
    Greeting,
    /// A buddy conversation: only lookups.
    Buddy,
    /// Fingerprints arriving (and data for the chunks wanted so far).
    Prints,
    /// All prints in; data and dirty rounds.
    Transfer,
    /// The source paused its writers: the last data, then the digest.
    Paused,
    /// The digest was compared; only `Switch` (or `Abort`) may follow.
    Verifying,
    /// `Switch` arrived; nothing more.
    Switched,
    /// `Abort` arrived; nothing more.
    Aborted,
}

impl DestinationState {
    fn describe(self) -> &'static str {
        match self {
            DestinationState::Greeting => "before Hello",
            DestinationState::Buddy => "on a buddy lookup connection",
            DestinationState::Prints => "while fingerprints arrive",
            DestinationState::Transfer => "during the data rounds",
            DestinationState::Paused => "after Pause",
            DestinationState::Verifying => "after Digest",
            DestinationState::Switched => "after Switch",
            DestinationState::Aborted => "after Abort",
        }
    }
}

/// What a destination accepts, message by message.
#[derive(Debug, Clone)]
pub struct DestinationOrder {
    state: DestinationState,
    next_round: u32,
}

impl Default for DestinationOrder {
    fn default() -> Self {
        Self::new()
    }
}

impl DestinationOrder {
    pub fn new() -> Self {
        DestinationOrder {
            state: DestinationState::Greeting,
            next_round: 0,
        }
    }

    pub fn state(&self) -> DestinationState {
        self.state
    }

    /// Check `m` against the state and move on; on error the state is
    /// unchanged and the connection should end.
    pub fn receive(&mut self, m: &Message) -> Result<DestinationState, ProtocolViolation> {
        use DestinationState as S;
        use MessageType as T;
        let next = match (self.state, m.kind()) {
            (S::Switched | S::Aborted, _) => None,
            (_, T::Abort) => Some(S::Aborted),
            (S::Greeting, T::Hello) => Some(S::Prints),
            (S::Greeting | S::Buddy, T::Lookup) => Some(S::Buddy),
            (S::Prints, T::Prints | T::Data) => Some(S::Prints),
            (S::Prints, T::PrintsDone) => Some(S::Transfer),
            (S::Prints | S::Transfer, T::Ping) => Some(self.state),
            (S::Transfer, T::Data) => Some(S::Transfer),
            (S::Transfer, T::RoundEnd) => match m {
                Message::RoundEnd { round, .. } if *round == self.next_round => {
                    self.next_round = round.saturating_add(1);
                    Some(S::Transfer)
                }
                _ => None,
            },
            // Pausing before the wanted data was synced (RoundEnd 0) would
            // make the pause carry the whole transfer.
            (S::Transfer, T::Pause) if self.next_round > 0 => Some(S::Paused),
            (S::Paused, T::Data) => Some(S::Paused),
            (S::Paused, T::Digest) => Some(S::Verifying),
            (S::Verifying, T::Switch) => Some(S::Switched),
            _ => None,
        };
        match next {
            Some(s) => {
                self.state = s;
                Ok(s)
            }
            None => Err(ProtocolViolation {
                got: m.name(),
                state: if m.kind() == T::RoundEnd && self.state == S::Transfer {
                    "out of round order"
                } else if m.kind() == T::Pause && self.state == S::Transfer {
                    "before the first round was synced"
                } else {
                    self.state.describe()
                },
            }),
        }
    }
}

/// Where a source is in one conversation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SourceState {
    /// `Hello` sent; waiting for the answer.
    AwaitWelcome,
    /// Fingerprints going out; wants coming back.
    Prints,
    /// Rounds: each `RoundEnd` sent is answered by its `Synced`.
    Rounds,
    /// `Digest` sent; `DigestResult`, then `Done` once `Switch` is sent.
    Verdict,
    /// `Done` received, or the destination refused or aborted.
    Ended,
}

/// What a source accepts from its destination, given what it sent.
#[derive(Debug, Clone)]
pub struct SourceOrder {
    state: SourceState,
    /// The previous connection ended after `Switch`: the answer to `Hello`
    /// may be `Done`.
    switch_pending: bool,
    /// Rounds ended (sent) and not yet answered, oldest first.
    unsynced: std::collections::VecDeque<u32>,
    digest_answered: bool,
    switch_sent: bool,
    /// Pings sent and not yet answered, oldest first.
    unanswered_pings: std::collections::VecDeque<u64>,
}

impl SourceOrder {
    pub fn new(switch_pending: bool) -> Self {
        SourceOrder {
            state: SourceState::AwaitWelcome,
            switch_pending,
            unsynced: Default::default(),
            digest_answered: false,
            switch_sent: false,
            unanswered_pings: Default::default(),
        }
    }

    pub fn state(&self) -> SourceState {
        self.state
    }

    /// Record a message the source sent.
    pub fn sent(&mut self, m: &Message) {
        match m {
            Message::RoundEnd { round, .. } => self.unsynced.push_back(*round),
            Message::Digest { .. } => self.state = SourceState::Verdict,
            Message::Switch => self.switch_sent = true,
            Message::Ping { nonce } => self.unanswered_pings.push_back(*nonce),
            _ => {}
        }
    }

    /// Check a message from the destination.
    pub fn receive(&mut self, m: &Message) -> Result<SourceState, ProtocolViolation> {
        use MessageType as T;
        use SourceState as S;
        let bad = |state: &'static str| ProtocolViolation {
            got: m.name(),
            state,
        };
        let next = match (self.state, m.kind()) {
            (S::Ended, _) => return Err(bad("after the conversation ended")),
            (_, T::Abort) => S::Ended,
            (S::AwaitWelcome, T::Welcome) => S::Prints,
            (S::AwaitWelcome, T::Refuse) => S::Ended,
            (S::AwaitWelcome, T::Done) if self.switch_pending => S::Ended,
            (S::AwaitWelcome, _) => return Err(bad("before Welcome")),
            (_, T::Pong) => match (m, self.unanswered_pings.front()) {
                (Message::Pong { nonce }, Some(n)) if nonce == n => {
                    self.unanswered_pings.pop_front();
                    self.state
                }
                _ => return Err(bad("for a Ping that was not sent")),
            },
            (S::Prints, T::Want) => S::Prints,
            (S::Prints, T::WantDone) => S::Rounds,
            (S::Prints, T::Synced) => return Err(bad("before WantDone")),
            (S::Rounds | S::Verdict, T::Synced) => match (m, self.unsynced.front()) {
                (Message::Synced { round }, Some(r)) if round == r => {
                    self.unsynced.pop_front();
                    self.state
                }
                _ => return Err(bad("for a round that was not ended")),
            },
            (S::Verdict, T::DigestResult) if !self.digest_answered => {
                self.digest_answered = true;
                S::Verdict
            }
            (S::Verdict, T::Done) if self.digest_answered && self.switch_sent => S::Ended,
            (S::Verdict, _) => return Err(bad("while waiting for the verdict")),
            (S::Prints, _) => return Err(bad("while fingerprints go out")),
            (S::Rounds, _) => return Err(bad("during the data rounds")),
        };
        self.state = next;
        Ok(next)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::{Encoding, VolumeDescriptor};
    use bytes::Bytes;

    fn hello() -> Message {
        Message::Hello {
            min_version: 2,
            max_version: 2,
            migration_id: [1; 16],
            volume: VolumeDescriptor {
                name: "v".into(),
                size: 1 << 20,
                block_size: 512,
                chunk_size: 4096,
                uuid: [2; 16],
                wwn: "naa.3".into(),
                allocated: 0,
                physical_block_size: 512,
            },
            iscsi: crate::IscsiPort::default(),
            arrived_under: String::new(),
        }
    }

    fn data() -> Message {
        Message::Data {
            offset: 0,
            encoding: Encoding::Raw,
            raw_len: 1,
            bytes: Bytes::from_static(b"x"),
        }
    }

    fn round(n: u32) -> Message {
        Message::RoundEnd {
            round: n,
            dirty_bytes: 0,
        }
    }

    #[test]
    fn destination_accepts_the_documented_sequence() {
        let mut o = DestinationOrder::new();
        let seq = [
            hello(),
            Message::Prints {
                first_chunk: 0,
                entries: vec![],
            },
            data(),
            Message::PrintsDone,
            data(),
            round(0),
            data(),
            round(1),
            Message::Pause,
            data(),
            Message::Digest { digest: [0; 32] },
            Message::Switch,
        ];
        for m in &seq {
            o.receive(m).unwrap();
        }
        assert_eq!(o.state(), DestinationState::Switched);
        assert!(o.receive(&data()).is_err());
    }

    #[test]
    fn destination_refuses_skipped_steps() {
        let cases: Vec<Vec<Message>> = vec![
            vec![data()],
            vec![Message::PrintsDone],
            vec![hello(), hello()],
            vec![hello(), round(0)],
            vec![hello(), Message::Pause],
            vec![hello(), Message::PrintsDone, Message::Pause],
            vec![hello(), Message::PrintsDone, round(1)],
            vec![hello(), Message::PrintsDone, round(0), round(0)],
            vec![
                hello(),
                Message::PrintsDone,
                Message::Digest { digest: [0; 32] },
            ],
            vec![
                hello(),
                Message::PrintsDone,
                round(0),
                Message::Pause,
                Message::Switch,
            ],
            vec![
                hello(),
                Message::PrintsDone,
                round(0),
                Message::Pause,
                Message::Digest { digest: [0; 32] },
                data(),
            ],
            vec![hello(), Message::Synced { round: 0 }],
            vec![
                hello(),
                Message::Welcome {
                    version: 2,
                    basis: crate::CopyBasis::New,
                    iscsi: crate::IscsiPort::default(),
                },
            ],
            vec![
                Message::Lookup {
                    block_size: 4096,
                    keys: vec![],
                },
                hello(),
            ],
        ];
        for case in cases {
            let mut o = DestinationOrder::new();
            let (last, init) = case.split_last().unwrap();
            for m in init {
                o.receive(m).unwrap_or_else(|e| panic!("{case:?}: {e}"));
            }
            let before = o.state();
            assert!(o.receive(last).is_err(), "{case:?} was accepted");
            assert_eq!(o.state(), before, "a refusal changes nothing");
        }
    }

    #[test]
    fn abort_ends_everywhere_but_after_switch() {
        let abort = Message::Abort { reason: "x".into() };
        let mut o = DestinationOrder::new();
        o.receive(&abort).unwrap();
        assert_eq!(o.state(), DestinationState::Aborted);
        assert!(o.receive(&hello()).is_err());
    }

    #[test]
    fn source_follows_its_own_sends() {
        let mut o = SourceOrder::new(false);
        assert!(o
            .receive(&Message::Done {
                location: "x".into(),
                admin: String::new(),
                iscsi: crate::IscsiPort::default(),
            })
            .is_err());
        o.receive(&Message::Welcome {
            version: 2,
            basis: crate::CopyBasis::New,
            iscsi: crate::IscsiPort::default(),
        })
        .unwrap();
        o.receive(&Message::Want {
            ranges: vec![(0, 1)],
        })
        .unwrap();
        assert!(o.receive(&Message::Synced { round: 0 }).is_err());
        o.receive(&Message::WantDone {
            local_chunks: 0,
            buddy_chunks: 0,
            resumed_chunks: 0,
        })
        .unwrap();
        assert!(
            o.receive(&Message::Synced { round: 0 }).is_err(),
            "no RoundEnd sent"
        );
        o.sent(&round(0));
        o.sent(&round(1));
        assert!(
            o.receive(&Message::Synced { round: 1 }).is_err(),
            "out of order"
        );
        o.receive(&Message::Synced { round: 0 }).unwrap();
        o.receive(&Message::Synced { round: 1 }).unwrap();
        assert!(o
            .receive(&Message::DigestResult {
                matches: true,
                digest: [0; 32]
            })
            .is_err());
        o.sent(&Message::Digest { digest: [0; 32] });
        assert!(
            o.receive(&Message::Done {
                location: "x".into(),
                admin: String::new(),
                iscsi: crate::IscsiPort::default(),
            })
            .is_err(),
            "no verdict yet"
        );
        o.receive(&Message::DigestResult {
            matches: true,
            digest: [0; 32],
        })
        .unwrap();
        assert!(
            o.receive(&Message::Done {
                location: "x".into(),
                admin: String::new(),
                iscsi: crate::IscsiPort::default(),
            })
            .is_err(),
            "no Switch sent"
        );
        o.sent(&Message::Switch);
        o.receive(&Message::Done {
            location: "x".into(),
            admin: String::new(),
            iscsi: crate::IscsiPort::default(),
        })
        .unwrap();
        assert_eq!(o.state(), SourceState::Ended);
    }

    #[test]
    fn pings_are_answered_in_the_phases_that_allow_them() {
        let ping = |n| Message::Ping { nonce: n };
        let pong = |n| Message::Pong { nonce: n };
        let mut d = DestinationOrder::new();
        assert!(d.receive(&ping(1)).is_err(), "before Hello");
        d.receive(&hello()).unwrap();
        d.receive(&ping(1)).unwrap();
        assert_eq!(d.state(), DestinationState::Prints, "a ping moves nothing");
        d.receive(&Message::PrintsDone).unwrap();
        d.receive(&ping(2)).unwrap();
        d.receive(&round(0)).unwrap();
        d.receive(&Message::Pause).unwrap();
        assert!(d.receive(&ping(3)).is_err(), "not in the pause");

        let welcome = Message::Welcome {
            version: 9,
            basis: crate::CopyBasis::New,
            iscsi: crate::IscsiPort::default(),
        };
        let mut o = SourceOrder::new(false);
        o.sent(&ping(1));
        assert!(o.receive(&pong(1)).is_err(), "before Welcome");
        o.receive(&welcome).unwrap();
        o.receive(&pong(1)).unwrap();
        assert!(o.receive(&pong(1)).is_err(), "answered once");
        o.sent(&ping(2));
        o.sent(&ping(3));
        assert!(o.receive(&pong(3)).is_err(), "out of order");
        o.receive(&pong(2)).unwrap();
        o.receive(&pong(3)).unwrap();
        assert_eq!(o.state(), SourceState::Prints);
    }

    #[test]
    fn source_accepts_done_on_greeting_only_after_a_lost_switch() {
        let done = Message::Done {
            location: "x".into(),
            admin: String::new(),
            iscsi: crate::IscsiPort::default(),
        };
        assert!(SourceOrder::new(false).receive(&done).is_err());
        assert!(SourceOrder::new(true).receive(&done).is_ok());
    }
}
