//! The allocator's operations on IP reservations: adding, listing and deleting them (the objects,
//! their validation and the merged reserved ranges: `model::reservations`).

use crate::allocator::Ipam;
use crate::model::error::IpamError;
use crate::model::reservations::{
    reservation_key, reservations_dir, validate_reservation, validate_reservation_name, Reservation,
};
use crate::model::{decode, encode};

impl Ipam {
    /// Creates a reservation, in one compare-and-swap that requires its name to be free.
    ///
    /// # Errors
    /// [`IpamError::InvalidArgument`] (see [`validate_reservation`]);
    /// [`IpamError::ReservationExists`]; store failures. Nothing is written on error.
    pub async fn add_reservation(&self, reservation: &Reservation) -> Result<(), IpamError> {
        validate_reservation(reservation)?;
        let key = reservation_key(&reservation.name);
        let value = encode(reservation)?;
        self.retrying(|| async {
            let (read, generation) = self.read_with_generation(&key).await?;
            if read.is_some() {
                return Err(IpamError::ReservationExists(reservation.name.clone()));
            }
            let mut plan = self.plan();
            plan.expect(&key, None);
            plan.put(&key, value.clone());
            self.bump_pool_generation(&mut plan, generation)?;
            self.commit_plan(plan, ()).await
        })
        .await
    }

    /// Every reservation, sorted by name.
    ///
    /// # Errors
    /// [`IpamError::Corrupt`] naming a reservation that does not decode; store failures.
    pub async fn list_reservations(&self) -> Result<Vec<Reservation>, IpamError> {
        self.list_reservations_each()
            .await?
            .into_iter()
            .map(|(_, reservation)| reservation)
            .collect()
    }

    /// Every reservation, sorted by name, each with what it reserves or, for one that cannot be
    /// decoded, the corrupt-object error naming its key: one damaged reservation hides no other.
    ///
    /// # Errors
    /// Store failures.
    pub async fn list_reservations_each(
        &self,
    ) -> Result<Vec<(String, Result<Reservation, IpamError>)>, IpamError> {
        let dir = reservations_dir();
        let listed = self.store().list(&dir).await?;
        let mut reservations: Vec<(String, Result<Reservation, IpamError>)> = listed
            .iter()
            .map(|kv| {
                let name = kv.key.strip_prefix(&dir).unwrap_or(&kv.key).to_owned();
                (name, decode::<Reservation>(&kv.key, &kv.value))
            })
            .collect();
        reservations.sort_by(|(a, _), (b, _)| a.cmp(b));
        Ok(reservations)
    }

    /// Deletes a reservation (one compare-and-swap at the revision read) and returns what it
    /// held. Addresses it covered become assignable again; allocations are untouched.
    ///
    /// # Errors
    /// [`IpamError::InvalidArgument`] for an invalid name; [`IpamError::ReservationNotFound`];
    /// store failures.
    pub async fn delete_reservation(&self, name: &str) -> Result<Reservation, IpamError> {
        validate_reservation_name(name)?;
        let key = reservation_key(name);
        self.retrying(|| async {
            let (read, generation) = self.read_with_generation(&key).await?;
            let Some(read) = read else {
                return Err(IpamError::ReservationNotFound(name.to_owned()));
            };
            // A damaged record is deleted all the same: it names what the operator asked for.
            let held = decode::<Reservation>(&key, &read.value).unwrap_or(Reservation {
                name: name.to_owned(),
                cidrs: Vec::new(),
            });
            let mut plan = self.plan();
            plan.expect(&key, Some(read.revision));
            plan.delete(&key);
            self.bump_pool_generation(&mut plan, generation)?;
            self.commit_plan(plan, held).await
        })
        .await
    }
}
