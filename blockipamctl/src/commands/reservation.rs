//! `reservation add|list|delete`: IP reservations (Calico's `IPReservation`), addresses that
//! auto-assign never hands out.

use blockipam_store::DatastoreSettings;
use ipam_core::reservations::{parse_reserved_cidr, validate_reservation, Reservation};
use serde::Serialize;

use super::pool::invalid_text;
use super::{open_ipam, to_json};
use crate::cli::{ReservationAddArgs, ReservationDeleteArgs};
use crate::error::CtlError;
use crate::output::{Outcome, Table};
use crate::settings::OpenMode;

/// One reservation as JSON: `{name, cidrs}` (Calico: `metadata.name`, `spec.reservedCIDRs`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ReservationJson {
    /// Its name.
    pub name: String,
    /// The reserved CIDRs, single addresses as /32 or /128.
    pub cidrs: Vec<String>,
}

impl From<&Reservation> for ReservationJson {
    fn from(reservation: &Reservation) -> Self {
        ReservationJson {
            name: reservation.name.clone(),
            cidrs: reservation.cidrs.iter().map(|c| c.to_string()).collect(),
        }
    }
}

/// `reservation add NAME CIDR|IP...`: validates before touching the store (a malformed address,
/// a CIDR with host bits or a bad name is a usage error), then creates the reservation.
///
/// # Errors
/// [`CtlError::Usage`] for invalid input; [`CtlError::Failed`] when the name is taken or the store
/// is in trouble.
pub async fn add(
    settings: &DatastoreSettings,
    args: &ReservationAddArgs,
) -> Result<Outcome, CtlError> {
    let cidrs = args
        .cidrs
        .iter()
        .map(|text| parse_reserved_cidr(text))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| CtlError::usage(invalid_text(&e)))?;
    let reservation = Reservation {
        name: args.name.clone(),
        cidrs,
    };
    validate_reservation(&reservation).map_err(|e| CtlError::usage(invalid_text(&e)))?;
    let ipam = open_ipam(settings, OpenMode::Existing).await?;
    ipam.add_reservation(&reservation).await?;
    let json = ReservationJson::from(&reservation);
    let table = format!(
        "Created IP reservation {}: {}.\n",
        json.name,
        json.cidrs.join(", ")
    );
    Ok(Outcome::ok(to_json(&json)?, table))
}

/// `reservation list`.
///
/// # Errors
/// Store trouble; a reservation that does not decode.
pub async fn list(settings: &DatastoreSettings) -> Result<Outcome, CtlError> {
    let ipam = open_ipam(settings, OpenMode::Existing).await?;
    let reservations = ipam.list_reservations().await?;
    let json: Vec<ReservationJson> = reservations.iter().map(ReservationJson::from).collect();
    let table = if json.is_empty() {
        "No IP reservations. Create one with: blockipamctl reservation add <NAME> <CIDR|IP>...\n"
            .to_owned()
    } else {
        let mut table = Table::new(&["NAME", "CIDRS"]);
        for row in &json {
            table.row(vec![row.name.clone(), row.cidrs.join(",")]);
        }
        table.render()
    };
    Ok(Outcome::ok(to_json(&json)?, table))
}

/// `reservation delete NAME`.
///
/// # Errors
/// [`CtlError::Usage`] for an invalid name; [`CtlError::Failed`] for an unknown reservation or
/// store trouble.
pub async fn delete(
    settings: &DatastoreSettings,
    args: &ReservationDeleteArgs,
) -> Result<Outcome, CtlError> {
    ipam_core::reservations::validate_reservation_name(&args.name)
        .map_err(|e| CtlError::usage(invalid_text(&e)))?;
    let ipam = open_ipam(settings, OpenMode::Existing).await?;
    let deleted = ipam.delete_reservation(&args.name).await?;
    let json = ReservationJson::from(&deleted);
    let table = format!(
        "Deleted IP reservation {}; its addresses may be auto-assigned again.\n",
        json.name
    );
    Ok(Outcome::ok(to_json(&json)?, table))
}
