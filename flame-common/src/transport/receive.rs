//! The receiving side's rules, the same on every transport's connection and
//! written once here: one receive at a time per connection, what a receive
//! whose future is dropped half-way means, and how a failed receive ends the
//! connection.
//!
//! * **One receive at a time.** A connection's receive state (tcp's buffer, or
//!   nothing for transports that keep theirs elsewhere) lives in a
//!   [`Receiver`]; [`Receiver::begin`] takes it out for the one receive
//!   running, and a second concurrent receive is refused with an error.
//! * **Drop-safe.** The [`Turn`] puts the state back however the receive ends,
//!   also when its future is dropped (a timeout raced against it, a task
//!   cancelled), and what that means is said once per transport
//!   ([`Abandoned`]): on shm (a record is taken from the ring whole) and rdma
//!   (the decoder keeps a message's progress in the connection) the next
//!   receive goes on where it stopped; on tcp the connection closes, because
//!   every place a tcp receive waits either holds a socket receive in flight
//!   (io_uring: bytes it took are gone with it) or is past a header whose
//!   payload is unread, and either way nothing could find the next message. So
//!   a connection is never left half-working.
//! * **One error policy** ([`Ending::after`]): a peer of another protocol
//!   version, and a refused one-sided access, close once what is queued was
//!   sent (the refusal reply in the peer's format, or the access refusal,
//!   reaches it); every other error closes at once.

use super::TransportError;
use crate::protocol::{Message, ProtocolError};
use std::cell::{Cell, RefCell};
use std::io;
use std::ops::{Deref, DerefMut};

/// How a receive's result ends the connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ending {
    /// It stays open.
    Open,
    /// Close once what is queued has been sent.
    CloseAfterSend,
    /// Close now.
    Close,
}

impl Ending {
    /// The one policy: see the module's documentation.
    pub fn after(result: &Result<Message, TransportError>) -> Ending {
        match result {
            Ok(_) => Ending::Open,
            Err(TransportError::Protocol(ProtocolError::ForeignVersion { .. }))
            | Err(TransportError::Refused(_)) => Ending::CloseAfterSend,
            Err(_) => Ending::Close,
        }
    }
}

/// What a receive whose future was dropped means for its connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Abandoned {
    /// Nothing: the next receive goes on where it stopped.
    Resumes,
    /// The connection closes: the stream's place is lost.
    Closes,
}

/// A connection's receive state and its turn-taking (one thread).
#[derive(Debug)]
pub struct Receiver<S> {
    /// `None` while a receive runs.
    state: RefCell<Option<S>>,
    abandoned: Abandoned,
}

impl<S> Receiver<S> {
    /// A receiver holding `state`, no receive running, whose abandoned
    /// receives mean `abandoned`.
    pub fn new(state: S, abandoned: Abandoned) -> Receiver<S> {
        Receiver {
            state: RefCell::new(Some(state)),
            abandoned,
        }
    }

    /// Starts the one receive a connection may run: its state, until the
    /// [`Turn`] is dropped. `close` closes the connection (called if the turn
    /// is dropped unended and abandoned receives close). An error if a receive
    /// runs.
    pub fn begin<'a>(&'a self, close: &'a dyn Fn()) -> Result<Turn<'a, S>, TransportError> {
        let Some(state) = self.state.borrow_mut().take() else {
            return Err(TransportError::Io(io::Error::other(
                "two tasks receiving on one connection",
            )));
        };
        Ok(Turn {
            receiver: self,
            state: Some(state),
            close,
            ended: Cell::new(false),
        })
    }
}

/// The running receive's hold on a connection's [`Receiver`].
pub struct Turn<'a, S> {
    receiver: &'a Receiver<S>,
    /// `Some` until dropped.
    state: Option<S>,
    close: &'a dyn Fn(),
    /// [`Turn::end`] ran: the receive was not abandoned.
    ended: Cell<bool>,
}

impl<S> Turn<'_, S> {
    /// Ends the receive with its result and says how the connection ends
    /// ([`Ending::after`]).
    pub fn end(self, result: &Result<Message, TransportError>) -> Ending {
        self.ended.set(true);
        Ending::after(result)
    }
}

impl<S> Deref for Turn<'_, S> {
    type Target = S;
    fn deref(&self) -> &S {
        match &self.state {
            Some(s) => s,
            None => unreachable!("a turn's state is taken only when it is dropped"),
        }
    }
}

impl<S> DerefMut for Turn<'_, S> {
    fn deref_mut(&mut self) -> &mut S {
        match &mut self.state {
            Some(s) => s,
            None => unreachable!("a turn's state is taken only when it is dropped"),
        }
    }
}

impl<S> Drop for Turn<'_, S> {
    fn drop(&mut self) {
        if !self.ended.get() && self.receiver.abandoned == Abandoned::Closes {
            // Abandoned: nothing finds the next message.
            (self.close)();
        }
        *self.receiver.state.borrow_mut() = self.state.take();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_error_policy() {
        assert_eq!(
            Ending::after(&Err(TransportError::Protocol(
                ProtocolError::ForeignVersion {
                    peer_version: 1,
                    request_id: 0,
                }
            ))),
            Ending::CloseAfterSend
        );
        assert_eq!(
            Ending::after(&Err(TransportError::Refused("no"))),
            Ending::CloseAfterSend
        );
        assert_eq!(Ending::after(&Err(TransportError::Closed)), Ending::Close);
    }

    /// One receive at a time; a dropped turn gives the state back (the next
    /// receive works) and closes the connection only where abandoned receives
    /// close, and only when it was not ended.
    #[test]
    fn turns_are_exclusive_and_drop_safe() {
        let closed = Cell::new(0);
        let close = || closed.set(closed.get() + 1);
        for (abandoned, closes) in [(Abandoned::Resumes, 0), (Abandoned::Closes, 1)] {
            closed.set(0);
            let rx = Receiver::new(7u32, abandoned);
            let mut t = rx.begin(&close).unwrap();
            *t += 1;
            assert!(rx.begin(&close).is_err(), "a second receive while one runs");
            drop(t);
            assert_eq!(closed.get(), closes, "{abandoned:?}");
            let t = rx.begin(&close).unwrap();
            assert_eq!(*t, 8, "the state came back");
            assert_eq!(t.end(&Err(TransportError::Closed)), Ending::Close);
            assert_eq!(closed.get(), closes, "an ended receive is not abandoned");
            assert!(rx.begin(&close).is_ok());
        }
    }
}
